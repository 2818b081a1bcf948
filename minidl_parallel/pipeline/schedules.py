"""Pipeline schedules as plain data: which micro-batch each stage runs forward or backward, in what order.

A pipeline cuts the model by depth into ``stages`` (one per rank of the pipeline group) and the batch
into ``micro_batches``. A schedule is, per stage, the ordered list of its actions: ``F3`` (forward of
micro-batch 3) or ``B3`` (its backward). Nothing here communicates or touches a tensor: the executor
runs a stage's list in order, receiving before and sending after each action as ``messages(stage)``
says, so a schedule can be printed, tested and compared before anything runs (the habit of DTensor's
redistribution plans).

The two schedulers are MindSpore's (``pipeline_config={"pipeline_scheduler": ...}``):

- ``"gpipe"``: every forward (0 .. m-1), then every backward (0 .. m-1, the order of PyTorch's
  ScheduleGPipe). A stage holds the activations of all m micro-batches at once.
- ``"1f1b"`` (PipeDream-Flush, as Megatron-LM and PyTorch's Schedule1F1B): stage s runs a warm-up of
  ``min(p - 1 - s, m)`` forwards, then alternates one forward and one backward, then a cool-down of
  the remaining backwards. A stage holds at most ``min(p - s, m)`` micro-batches' activations.

With every forward and backward one time slot long, both take ``2 (m + p - 1)`` slots per step and
leave each stage idle ``2 (p - 1)`` of them: the bubble is ``(p - 1) / (m + p - 1)`` of the step for
both; 1F1B saves memory, not time. ``timeline()`` simulates this and ``str(schedule)`` prints it:

    >>> print(pipeline_schedule(2, 2, "gpipe"))
    gpipe schedule: 2 stages, 2 micro-batches; bubble 1/3 of the step (2 idle slots of 6 per stage)
    stage 0 | F0 F1 .  .  B0 B1
    stage 1 | .  F0 F1 B0 B1 .
"""
from fractions import Fraction
from typing import NamedTuple

from ..pipeline_config import SCHEDULERS

__all__ = ["Action", "Message", "Schedule", "pipeline_schedule", "SCHEDULERS"]

# MindSpore 2.10 also names these; minidl builds none of them, and says so rather than "unknown".
_MINDSPORE_ONLY_SCHEDULERS = ("seqpipe", "seqvpp", "seqsmartvpp", "zero_bubble_v")

FORWARD, BACKWARD = "forward", "backward"


class Action(NamedTuple):
    """One unit of work on one stage: the forward or backward of one micro-batch. Prints ``F3`` / ``B3``."""

    kind: str    # "forward" or "backward"
    micro: int   # the micro-batch index, 0 .. m-1
    stage: int   # the stage that runs it

    def __str__(self):
        return f"{'F' if self.kind == FORWARD else 'B'}{self.micro}"


class Message(NamedTuple):
    """One point-to-point message of an action: ``recv`` before it or ``send`` after it, with ``peer``
    the other stage. A forward moves an activation up (to stage + 1), a backward a gradient down."""

    action: Action
    direction: str  # "send" or "recv"
    peer: int

    @property
    def payload(self):
        return "activation" if self.action.kind == FORWARD else "gradient"

    def __str__(self):
        return f"{self.direction} {self.action} {'to' if self.direction == 'send' else 'from'} stage {self.peer}"


def _check_count(name, value):
    # bool is an int subclass: pipeline_schedule(True, 4) is a bug, not one stage (MindSpore refuses it too).
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"pipeline_schedule: {name} must be an int >= 1, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"pipeline_schedule: {name} must be an int >= 1, got {value}")


def _check_scheduler(scheduler):
    if not isinstance(scheduler, str):
        raise TypeError(f"pipeline_schedule: scheduler must be one of {SCHEDULERS}, got {scheduler!r} "
                        f"({type(scheduler).__name__})")
    if scheduler in SCHEDULERS:
        return
    hint = ""
    if scheduler.lower() in SCHEDULERS:
        hint = f" (names are lowercase, as MindSpore's: use {scheduler.lower()!r})"
    elif scheduler in _MINDSPORE_ONLY_SCHEDULERS:
        hint = f" (MindSpore's {scheduler!r} is not built in minidl)"
    raise ValueError(f"pipeline_schedule: scheduler must be one of {SCHEDULERS}, got {scheduler!r}{hint}")


def _gpipe_actions(stages, micro_batches, stage):
    """Fill, then drain: all forwards, then all backwards in the same order (PyTorch's ScheduleGPipe)."""
    return ([Action(FORWARD, i, stage) for i in range(micro_batches)]
            + [Action(BACKWARD, i, stage) for i in range(micro_batches)])


def _one_f_one_b_actions(stages, micro_batches, stage):
    """PipeDream-Flush. The warm-up fills the pipe just enough that the last stage's first backward
    comes back the moment this stage could use it: stage s needs p - 1 - s forwards in flight ahead
    of it. Then each backward frees the activations a new forward takes, so memory stays flat."""
    warmup = min(stages - 1 - stage, micro_batches)
    actions = [Action(FORWARD, i, stage) for i in range(warmup)]
    forwards, backwards = warmup, 0
    while forwards < micro_batches:  # steady state: one forward, one backward
        actions += [Action(FORWARD, forwards, stage), Action(BACKWARD, backwards, stage)]
        forwards, backwards = forwards + 1, backwards + 1
    actions += [Action(BACKWARD, i, stage) for i in range(backwards, micro_batches)]  # cool-down
    return actions


_BUILDERS = {"gpipe": _gpipe_actions, "1f1b": _one_f_one_b_actions}


class Schedule:
    """The actions of every stage of one pipeline step (see the module docstring).

    Args:
        stages: the number of pipeline stages p (int >= 1).
        micro_batches: the number of micro-batches m per step (int >= stages, as MindSpore's
            PipelineCell requires micro_size >= stages).
        scheduler: "1f1b" (default, as MindSpore) or "gpipe".

    Example:
        >>> s = pipeline_schedule(4, 8)
        >>> " ".join(map(str, s.actions(0)))
        'F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7'
        >>> s.bubble_fraction(), s.peak_activations(0)
        (Fraction(3, 11), 4)
    """

    def __init__(self, stages, micro_batches, scheduler="1f1b"):
        _check_count("stages", stages)
        _check_count("micro_batches", micro_batches)
        _check_scheduler(scheduler)
        if micro_batches < stages:
            raise ValueError(f"pipeline_schedule: micro_batches ({micro_batches}) must be >= stages ({stages}), "
                             f"as MindSpore's PipelineCell requires micro_size >= pipeline stages")
        self._stages, self._micro_batches, self._scheduler = stages, micro_batches, scheduler
        build = _BUILDERS[scheduler]
        self._actions = tuple(tuple(build(stages, micro_batches, s)) for s in range(stages))
        self._timeline = None

    stages = property(lambda self: self._stages, doc="the number of pipeline stages p")
    micro_batches = property(lambda self: self._micro_batches, doc="the number of micro-batches m per step")
    scheduler = property(lambda self: self._scheduler, doc='"1f1b" or "gpipe"')

    def __repr__(self):
        return f"Schedule(stages={self._stages}, micro_batches={self._micro_batches}, scheduler={self._scheduler!r})"

    def _check_stage(self, stage):
        if not isinstance(stage, int) or isinstance(stage, bool):
            raise TypeError(f"stage must be an int in 0..{self._stages - 1}, got {stage!r} ({type(stage).__name__})")
        # No negative indexing: a stage is a rank's position in the pipe, and -1 is more likely a bug.
        if not 0 <= stage < self._stages:
            raise IndexError(f"stage {stage} is out of range: this schedule has stages 0..{self._stages - 1}")

    def actions(self, stage):
        """The ordered actions of ``stage`` (a list of Action)."""
        self._check_stage(stage)
        return list(self._actions[stage])

    def messages(self, stage):
        """What the executor of ``stage`` sends and receives, in execution order: before F(s, i) with
        s > 0 it receives the activation from s - 1; after it, with s < p - 1, sends its output to
        s + 1; before B(s, i) with s < p - 1 it receives the gradient from s + 1; after it, with s > 0,
        sends the input's gradient to s - 1. Between two stages the messages of one direction are
        sent and received in the same order, so they match without tags. Sends must not wait for
        their receive (buffered or non-blocking): in 1F1B two neighbours can send to each other at
        once; ``timeline()`` is the proof that receives alone then never deadlock."""
        self._check_stage(stage)
        last = self._stages - 1
        out = []
        for action in self._actions[stage]:
            if action.kind == FORWARD:
                if stage > 0:
                    out.append(Message(action, "recv", stage - 1))
                if stage < last:
                    out.append(Message(action, "send", stage + 1))
            else:
                if stage < last:
                    out.append(Message(action, "recv", stage + 1))
                if stage > 0:
                    out.append(Message(action, "send", stage - 1))
        return out

    def sends(self, stage):
        """The messages ``stage`` sends, in order (the subset of ``messages(stage)``)."""
        return [msg for msg in self.messages(stage) if msg.direction == "send"]

    def message_counts(self):
        """Messages sent per step over all stages, by payload: (p - 1) x m activations and as many gradients."""
        counts = {"activation": 0, "gradient": 0}
        for stage in range(self._stages):
            for msg in self.sends(stage):
                counts[msg.payload] += 1
        return counts

    def peak_activations(self, stage):
        """The most micro-batches whose forward ran on ``stage`` and whose backward has not, walking its
        actions in order: the activations it holds at once (m for GPipe, min(p - s, m) for 1F1B)."""
        self._check_stage(stage)
        held = peak = 0
        for action in self._actions[stage]:
            held += 1 if action.kind == FORWARD else -1
            peak = max(peak, held)
        return peak

    def timeline(self):
        """Simulate one step in unit time slots: every action takes one slot; F(s, i) may start once
        F(s - 1, i) finished in an earlier slot, B(s, i) once B(s + 1, i) did (on the last stage, once
        its own F(s, i) did), and each stage runs its actions strictly in order, as soon as it may.

        Returns:
            a tuple of slots; each slot a tuple with, per stage, the Action it runs or None (idle).
        """
        if self._timeline is None:
            self._timeline = self._simulate()
        return self._timeline

    def _simulate(self):
        p, last = self._stages, self._stages - 1
        finished = {}  # Action -> the slot it ran in
        position = [0] * p
        slots = []
        while any(position[s] < len(self._actions[s]) for s in range(p)):
            now = len(slots)
            slot = []
            for s in range(p):
                action = self._actions[s][position[s]] if position[s] < len(self._actions[s]) else None
                if action is not None:
                    if action.kind == FORWARD:
                        before = Action(FORWARD, action.micro, s - 1) if s > 0 else None
                    else:
                        before = Action(BACKWARD, action.micro, s + 1) if s < last else Action(FORWARD, action.micro, s)
                    if before is not None and finished.get(before, now) >= now:
                        action = None  # waits: what it needs has not finished in an earlier slot
                slot.append(action)
            if not any(slot):
                # Cannot happen for the schedules built here; a loop that never ends would hide it.
                raise RuntimeError(f"{self!r}: no stage can run in slot {now}: the actions deadlock")
            for s, action in enumerate(slot):
                if action is not None:
                    finished[action] = now
                    position[s] += 1
            slots.append(tuple(slot))
        return tuple(slots)

    def total_slots(self):
        """The length of one step in slots (2 (m + p - 1) for both schedulers)."""
        return len(self.timeline())

    def idle_slots(self, stage):
        """The slots of the step in which ``stage`` runs nothing (2 (p - 1) for both schedulers)."""
        self._check_stage(stage)
        return sum(1 for slot in self.timeline() if slot[stage] is None)

    def bubble_fraction(self):
        """The fraction of all stages' slots that are idle, exact: (p - 1) / (m + p - 1)."""
        idle = sum(self.idle_slots(s) for s in range(self._stages))
        return Fraction(idle, self._stages * self.total_slots())

    def __str__(self):
        timeline = self.timeline()
        width = max(len(str(a)) for slot in timeline for a in slot if a is not None)
        label = len(f"stage {self._stages - 1}")
        bubble = self.bubble_fraction()
        lines = [f"{self._scheduler} schedule: {self._stages} stages, {self._micro_batches} micro-batches; "
                 f"bubble {bubble} of the step ({self.idle_slots(0)} idle slots of {len(timeline)} per stage)"]
        for s in range(self._stages):
            cells = [(str(slot[s]) if slot[s] is not None else ".").ljust(width) for slot in timeline]
            lines.append(f"{f'stage {s}'.ljust(label)} | {' '.join(cells).rstrip()}")
        return "\n".join(lines)


def pipeline_schedule(stages, micro_batches, scheduler="1f1b"):
    """The schedule of one pipeline step: ``stages`` stages, ``micro_batches`` micro-batches, MindSpore's
    ``scheduler`` ("1f1b", its default, or "gpipe"). ``print()`` it to see the bubble. See Schedule."""
    return Schedule(stages, micro_batches, scheduler)
