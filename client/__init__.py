"""A small Python client for applications: publish tasks and experience groups to a run,
follow its model versions.

    from streamrft.client import StreamRFTClient, make_group

    async with StreamRFTClient("my-run", "127.0.0.1:9092") as client:
        version = await client.latest_version()
        await client.publish_tasks([{"id": "q-1", "prompt": "2+3=", "answer": "5"}])
        group = make_group("my-run", "q-1", [(prompt_ids, response_ids, logprobs, 1.0)],
                           model_version=version.version if version else 0)
        await client.publish_groups([group])
        async for event in client.versions():
            ...  # load event.uri, sample with it

Application layer: it uses the infra core (Kafka options, produce and consume paths) and
the wire types, never the explorer or the trainer.
"""

from streamrft.client.client import StreamRFTClient, client_config
from streamrft.client.groups import Rollout, make_group

__all__ = ["Rollout", "StreamRFTClient", "client_config", "make_group"]
