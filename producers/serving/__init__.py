"""Serve mode: the policy behind an OpenAI-compatible HTTP API that records experiences.

``streamrft serve CONFIG --run-id ID`` (:mod:`.server`) loads the run's policy with the
configured engine, follows the run's model versions like an explorer (a new version is
applied between two engine calls, never during one), and answers ``/v1/chat/completions``,
``/v1/completions``, ``/v1/models`` and ``/health`` (:mod:`.api`). Every completion is
recorded with its token ids, log-probs, action mask and model version (:mod:`.recorder`);
``POST /feedback`` gives a response (or a whole conversation) a reward and ``POST /commit``
(or ``serve.group_size`` / ``serve.group_timeout_s``) publishes the rewarded responses as
experience groups on ``experiences``, where the trainer consumes them like an explorer's.
"""
