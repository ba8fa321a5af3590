"""The one exception tree of streamrft.

Every error streamrft raises on purpose derives from :class:`StreamRFTError`. Each area
has its subclass; ``retriable`` says whether trying the same thing again may succeed
(a broker that is briefly down) or never will (a malformed message, a bad config).
Lives in ``schemas`` because that package imports nothing heavy, so any process can
catch these without torch or aiokafka.
"""

from __future__ import annotations


class StreamRFTError(Exception):
    """Root of every streamrft error."""

    retriable: bool = False


class ConfigError(StreamRFTError):
    """A configuration value is missing, of the wrong type or out of bounds.

    The message names the field (``trainer.batch_size``) and what was wrong.
    """


class Stalled(StreamRFTError):
    """A run that stopped because nothing can make progress (work is left that no process
    is doing): restarting the process that says so does not help; the message says what is
    left and who was expected to do it."""


class SchemaError(StreamRFTError):
    """A message failed to decode or validate against its wire schema."""


class ServiceError(StreamRFTError):
    """A local or remote service (broker, object store) could not be started or reached."""

    retriable = True


class SyncError(StreamRFTError):
    """A model version could not be published, fetched, verified or applied."""


class StoreUnavailable(SyncError):
    """The object store did not answer (refused, timed out, 5xx): it may be back soon."""

    retriable = True


class IntegrityError(SyncError):
    """A weight shard or manifest did not match its recorded sha256."""


class SyncTimeout(SyncError):
    """A wait for a model version ran past ``synchronizer.sync_timeout``."""

    retriable = True


class OutOfMemory(SyncError):
    """Memory for a version (its staging copy, a receive buffer of the size this model's
    versions have) could not be allocated: not the version's fault; the explorer keeps the
    weights it holds and tries again."""

    retriable = True


class VersionGone(SyncError):
    """The version being loaded was retired (``VersionsRetired``) while it was: nothing is
    wrong with it, it is no longer there to load; the explorer chooses a version again."""

    retriable = True


class RolloutError(StreamRFTError):
    """A task's workflow kept failing (raised, timed out or produced no group) through its
    retries; the task goes to the dead-letter topic with this reason."""


class SamplingInterrupted(RolloutError):
    """A sampling call was stopped between two tokens because its process is stopping
    (``RolloutEngine.interrupt``): its tasks are not committed and are explored again."""


class RewardServiceError(RolloutError):
    """A reward service (a judge model, the code sandbox) failed to score a response after
    its retries: the task's workflow call fails with this reason, and the task is tried
    again (``explorer.task_retries``), then dead-lettered with it."""


class StepNotUndone(StreamRFTError):
    """A training step failed after one of its optimizer updates was applied, and what the
    step changed had not been copied before it (a step of one update): the trainer exits
    rather than go on from part of a step or set aside groups the model learned from; the
    next trainer resumes from its checkpoint, from before the batch."""
