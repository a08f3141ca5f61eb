"""Continuous-batching scheduler over the hierarchical prefix cache (one thread owns model and cache)."""

from engine.scheduler.req import Req, ReqOutput
from engine.scheduler.sampling_params import SamplingParams
from engine.scheduler.scheduler import NotIdleError, Scheduler, SchedulerConfig

__all__ = ["NotIdleError", "Req", "ReqOutput", "SamplingParams", "Scheduler", "SchedulerConfig"]
