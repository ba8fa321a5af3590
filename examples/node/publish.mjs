// Publish one task and one experience group to a streamrft run, as JSON, with kafkajs.
//
//   node publish.mjs --bootstrap HOST:PORT --run RUN_ID [--prefix streamrft] [--input FILE]
//
// (or STREAMRFT_BOOTSTRAP, STREAMRFT_RUN, STREAMRFT_TOPIC_PREFIX, STREAMRFT_INPUT). Written
// from the JSON Schema of the wire types (schemas/json/*.schema.json): a record on
// `<prefix>.<run>.tasks` or `<prefix>.<run>.experiences` whose header `content-type` is
// `application/json` is JSON; its key is the task id. A task's JSON is the Task itself; an
// experience group carries token ids, log-probs and the action mask as number arrays.
//
// FILE (default: example-input.json beside this script) holds what an app would have:
//   { "task": {"id": ..., "prompt": ..., "answer": ...},
//     "model_version": 0,                       // the version that sampled the rollouts
//     "explorer": "node-app",                   // optional: the app's name
//     "rollouts": [ {"prompt_ids": [...], "response_ids": [...], "logprobs": [...],
//                    "reward": 1.0, "action_mask": [...], "response_text": "..."}, ... ] }
// Token ids are the trainer's tokenizer's ids (example-input.json: the tiny example
// model's character tokenizer). Prints one JSON line: what was sent, and where.

import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";
import { Kafka, Partitioners, logLevel } from "kafkajs";

const JSON_HEADERS = { "content-type": "application/json", "streamrft-schema": "1" };

function options() {
  const { values } = parseArgs({
    options: {
      bootstrap: { type: "string", default: process.env.STREAMRFT_BOOTSTRAP },
      run: { type: "string", default: process.env.STREAMRFT_RUN },
      prefix: { type: "string", default: process.env.STREAMRFT_TOPIC_PREFIX ?? "streamrft" },
      input: {
        type: "string",
        default:
          process.env.STREAMRFT_INPUT ??
          join(dirname(fileURLToPath(import.meta.url)), "example-input.json"),
      },
    },
  });
  if (!values.bootstrap || !values.run) {
    throw new Error("usage: node publish.mjs --bootstrap HOST:PORT --run RUN_ID [--input FILE]");
  }
  return values;
}

// The experience group (ExperienceGroupJSON in the JSON Schema) of the input's rollouts.
function experienceGroup(run, task, rollouts, modelVersion, explorer) {
  const epoch = task.epoch ?? 0;
  const id = `${run}/${task.id}@${epoch}`; // one id per (run, task, epoch): sent twice, trained once
  const experiences = rollouts.map((r, i) => {
    if (r.logprobs.length !== r.response_ids.length) {
      throw new Error(`rollout ${i}: ${r.logprobs.length} log-probs for ${r.response_ids.length} tokens`);
    }
    return {
      id: `${id}#${i}`,
      tokens: [...r.prompt_ids, ...r.response_ids],
      prompt_length: r.prompt_ids.length,
      logprobs: r.logprobs,
      action_mask: r.action_mask ?? r.response_ids.map(() => 1),
      reward: r.reward,
      model_version: modelVersion,
      response_text: r.response_text ?? "",
    };
  });
  return {
    id,
    run,
    task_id: task.id,
    explorer,
    model_version: modelVersion,
    experiences,
    created_at: Date.now() / 1000,
    workflow: "node-app",
    epoch,
  };
}

async function main() {
  const opts = options();
  const input = JSON.parse(readFileSync(opts.input, "utf8"));
  const task = input.task;
  const group = experienceGroup(
    opts.run, task, input.rollouts, input.model_version ?? 0, input.explorer ?? "node-app",
  );
  const topics = { tasks: `${opts.prefix}.${opts.run}.tasks`, experiences: `${opts.prefix}.${opts.run}.experiences` };

  const kafka = new Kafka({
    clientId: "streamrft-node-example",
    brokers: opts.bootstrap.split(","),
    logLevel: logLevel.WARN,
  });
  // the Java client's partitioner (murmur2 of the key), as every other streamrft client
  const producer = kafka.producer({ createPartitioner: Partitioners.DefaultPartitioner });
  await producer.connect();
  try {
    const sent = {};
    for (const [kind, value] of [["tasks", task], ["experiences", group]]) {
      const [meta] = await producer.send({
        topic: topics[kind],
        acks: -1, // all in-sync replicas: published means the broker has it
        messages: [{ key: task.id, value: JSON.stringify(value), headers: JSON_HEADERS }],
      });
      sent[kind] = { topic: topics[kind], partition: meta.partition, offset: meta.baseOffset };
    }
    console.log(JSON.stringify({ task: task.id, group: group.id, experiences: group.experiences.length, sent }));
  } finally {
    await producer.disconnect();
  }
}

main().catch((err) => {
  console.error(`publish.mjs: ${err.message}`);
  process.exit(1);
});
