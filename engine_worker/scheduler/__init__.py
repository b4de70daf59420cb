"""The scheduler: ``Scheduler`` (scheduler.py) decides each step's batch and applies its output;
what crosses the seam to the engine is in batch.py; its side of the prefix cache in
prefix_sharing.py."""

from engine_worker.scheduler.batch import Finished, ScheduledBatch, StepUpdate
from engine_worker.scheduler.scheduler import Scheduler

__all__ = ["Finished", "ScheduledBatch", "Scheduler", "StepUpdate"]
