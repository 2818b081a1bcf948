"""Pipeline schedules as data: the action lists of GPipe and 1F1B, their timeline, bubble, memory and
messages. Expected orders are written out by hand (from PyTorch's ScheduleGPipe / Schedule1F1B and
Megatron's PipeDream-Flush), and the timeline is checked against its dependency rules independently
of the simulator that builds it."""
from fractions import Fraction

import pytest
from hypothesis import given, strategies as st

from minidl_parallel.pipeline import Action, Message, pipeline_schedule, Schedule


def _line(actions):
    return " ".join(map(str, actions))


# --- the action lists ---------------------------------------------------------------------------

def test_gpipe_runs_all_forwards_then_all_backwards_in_the_same_order():
    sched = pipeline_schedule(3, 4, "gpipe")
    for s in range(3):
        assert _line(sched.actions(s)) == "F0 F1 F2 F3 B0 B1 B2 B3"


def test_1f1b_warms_up_p_minus_1_minus_s_forwards_then_alternates_then_cools_down():
    sched = pipeline_schedule(4, 6)  # "1f1b" is the default, as MindSpore's
    assert sched.scheduler == "1f1b"
    assert _line(sched.actions(0)) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert _line(sched.actions(1)) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5"
    assert _line(sched.actions(2)) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5"
    assert _line(sched.actions(3)) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"


def test_actions_are_records_of_kind_micro_batch_and_stage():
    action = pipeline_schedule(2, 3).actions(1)[1]
    assert action == Action("backward", 0, 1) and (action.kind, action.micro, action.stage) == ("backward", 0, 1)
    assert str(action) == "B0" and str(Action("forward", 12, 0)) == "F12"
    with pytest.raises(AttributeError):
        action.micro = 1  # immutable
    sched = pipeline_schedule(2, 2)
    sched.actions(0).clear()  # a copy: the schedule is not changed through it
    assert len(sched.actions(0)) == 4


def test_a_single_stage_runs_each_micro_batch_forward_then_backward_with_no_bubble():
    sched = pipeline_schedule(1, 3)
    assert _line(sched.actions(0)) == "F0 B0 F1 B1 F2 B2"
    assert sched.bubble_fraction() == 0 and sched.messages(0) == [] and sched.peak_activations(0) == 1


# --- the timeline, bubble and memory ------------------------------------------------------------

def test_timeline_of_two_stages_worked_out_by_hand():
    # 1F1B p=2, m=2: stage 1 runs B0 right after F0 (it holds the loss); stage 0's B0 waits a slot
    # for stage 1's B0, and its B1 for stage 1's B1.
    one_f_one_b = pipeline_schedule(2, 2, "1f1b").timeline()
    assert [tuple(str(a) if a else "." for a in slot) for slot in one_f_one_b] == [
        ("F0", "."), ("F1", "F0"), (".", "B0"), ("B0", "F1"), (".", "B1"), ("B1", ".")]
    gpipe = pipeline_schedule(2, 2, "gpipe").timeline()
    assert [tuple(str(a) if a else "." for a in slot) for slot in gpipe] == [
        ("F0", "."), ("F1", "F0"), (".", "F1"), (".", "B0"), ("B0", "B1"), ("B1", ".")]


@pytest.mark.parametrize("scheduler", ["gpipe", "1f1b"])
def test_bubble_is_p_minus_1_over_m_plus_p_minus_1_for_every_p_up_to_6_and_m_up_to_10(scheduler):
    for p in range(1, 7):
        for m in range(p, 11):
            sched = pipeline_schedule(p, m, scheduler)
            assert sched.total_slots() == 2 * (m + p - 1), (p, m)
            assert [sched.idle_slots(s) for s in range(p)] == [2 * (p - 1)] * p, (p, m)
            assert sched.bubble_fraction() == Fraction(p - 1, m + p - 1), (p, m)


@pytest.mark.parametrize("scheduler", ["gpipe", "1f1b"])
def test_activations_held_are_m_for_gpipe_and_min_p_minus_s_m_for_1f1b(scheduler):
    for p in range(1, 7):
        for m in range(p, 11):
            sched = pipeline_schedule(p, m, scheduler)
            expected = [m] * p if scheduler == "gpipe" else [min(p - s, m) for s in range(p)]
            assert [sched.peak_activations(s) for s in range(p)] == expected, (p, m)


def test_str_prints_the_timeline_as_a_grid_with_the_bubble():
    assert str(pipeline_schedule(4, 4, "gpipe")) == "\n".join([
        "gpipe schedule: 4 stages, 4 micro-batches; bubble 3/7 of the step (6 idle slots of 14 per stage)",
        "stage 0 | F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3",
        "stage 1 | .  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3 .",
        "stage 2 | .  .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .  .",
        "stage 3 | .  .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .  ."])
    wide = str(pipeline_schedule(2, 11, "1f1b")).splitlines()
    assert wide[1].startswith("stage 0 | F0  F1  .   B0  F2  B1 ")  # columns as wide as "F10"
    assert len({len(line.split("|")[1]) for line in wide[1:]}) <= 2  # aligned (trailing "." trimmed)
    assert repr(pipeline_schedule(3, 4, "gpipe")) == "Schedule(stages=3, micro_batches=4, scheduler='gpipe')"


# --- messages -----------------------------------------------------------------------------------

def test_messages_of_a_middle_stage_in_execution_order():
    msgs = pipeline_schedule(3, 3, "1f1b").messages(1)
    assert [str(m) for m in msgs] == [
        "recv F0 from stage 0", "send F0 to stage 2", "recv F1 from stage 0", "send F1 to stage 2",
        "recv B0 from stage 2", "send B0 to stage 0", "recv F2 from stage 0", "send F2 to stage 2",
        "recv B1 from stage 2", "send B1 to stage 0", "recv B2 from stage 2", "send B2 to stage 0"]
    assert msgs[0] == Message(Action("forward", 0, 1), "recv", 0) and msgs[0].payload == "activation"
    assert msgs[4].payload == "gradient"


def test_first_and_last_stage_talk_only_to_their_one_neighbour():
    sched = pipeline_schedule(3, 4, "gpipe")
    assert {(m.direction, m.payload, m.peer) for m in sched.messages(0)} == {("send", "activation", 1),
                                                                             ("recv", "gradient", 1)}
    assert {(m.direction, m.payload, m.peer) for m in sched.messages(2)} == {("recv", "activation", 1),
                                                                             ("send", "gradient", 1)}
    assert sched.sends(0) == [m for m in sched.messages(0) if m.direction == "send"] and len(sched.sends(0)) == 4


@pytest.mark.parametrize("scheduler", ["gpipe", "1f1b"])
def test_p_minus_1_times_m_messages_per_direction_per_step(scheduler):
    for p, m in [(1, 3), (2, 2), (4, 8), (5, 7)]:
        assert pipeline_schedule(p, m, scheduler).message_counts() == {"activation": (p - 1) * m,
                                                                        "gradient": (p - 1) * m}


# --- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("stages, micro_batches, scheduler, error, words", [
    (0, 4, "1f1b", ValueError, "stages must be an int >= 1, got 0"),
    (True, 4, "1f1b", TypeError, "stages must be an int >= 1, got True (bool)"),
    (2.0, 4, "1f1b", TypeError, "stages must be an int >= 1, got 2.0 (float)"),
    (2, -1, "1f1b", ValueError, "micro_batches must be an int >= 1, got -1"),
    (2, "4", "1f1b", TypeError, "micro_batches must be an int >= 1, got '4' (str)"),
    (4, 2, "1f1b", ValueError, "micro_batches (2) must be >= stages (4)"),
    (3, 2, "gpipe", ValueError, "micro_batches (2) must be >= stages (3), as MindSpore's PipelineCell requires"),
    (2, 4, "1F1B", ValueError, "got '1F1B' (names are lowercase, as MindSpore's: use '1f1b')"),
    (2, 4, "GPipe", ValueError, "use 'gpipe'"),
    (2, 4, "seqpipe", ValueError, "MindSpore's 'seqpipe' is not built in minidl"),
    (2, 4, "interleaved", ValueError, "scheduler must be one of ('1f1b', 'gpipe'), got 'interleaved'"),
    (2, 4, None, TypeError, "scheduler must be one of ('1f1b', 'gpipe'), got None"),
])
def test_arguments_are_checked_with_messages_naming_the_value(stages, micro_batches, scheduler, error, words):
    with pytest.raises(error, match="^pipeline_schedule: ") as info:
        pipeline_schedule(stages, micro_batches, scheduler)
    assert words in str(info.value)


def test_a_stage_out_of_range_names_the_range():
    sched = pipeline_schedule(3, 3)
    for method in (sched.actions, sched.messages, sched.sends, sched.idle_slots, sched.peak_activations):
        with pytest.raises(IndexError, match=r"stage 3 is out of range: this schedule has stages 0\.\.2"):
            method(3)
        with pytest.raises(IndexError, match=r"stage -1 is out of range"):
            method(-1)
        with pytest.raises(TypeError, match=r"stage must be an int in 0\.\.2, got '1'"):
            method("1")


# --- the property: every schedule is complete, ordered, and its timeline keeps every dependency ---

@given(p=st.integers(1, 6), extra=st.integers(0, 8), scheduler=st.sampled_from(["gpipe", "1f1b"]))
def test_every_schedule_is_complete_and_its_timeline_respects_every_dependency(p, extra, scheduler):
    m = p + extra
    sched = Schedule(p, m, scheduler)
    assert (sched.stages, sched.micro_batches, sched.scheduler) == (p, m, scheduler)
    for s in range(p):
        actions = sched.actions(s)
        assert sorted(actions) == sorted([Action(k, i, s) for k in ("forward", "backward") for i in range(m)])
        for i in range(m):
            assert actions.index(Action("forward", i, s)) < actions.index(Action("backward", i, s))

    timeline = sched.timeline()
    assert len(timeline) == 2 * (m + p - 1) and all(len(slot) == p for slot in timeline)
    slot_of = {}
    for t, slot in enumerate(timeline):
        for s, action in enumerate(slot):
            if action is not None:
                assert action.stage == s and action not in slot_of
                slot_of[action] = t
    assert len(slot_of) == 2 * m * p  # every action ran once
    for s in range(p):
        ran = [a for slot in timeline for a in [slot[s]] if a is not None]
        assert ran == sched.actions(s)  # strictly in the stage's order
        for a in ran:
            if a.kind == "forward" and s > 0:
                assert slot_of[Action("forward", a.micro, s - 1)] < slot_of[a]
            if a.kind == "backward":
                needed = Action("backward", a.micro, s + 1) if s < p - 1 else Action("forward", a.micro, s)
                assert slot_of[needed] < slot_of[a]

    # Between neighbours the sends of one direction arrive in the order the receiver expects them,
    # so the executor needs no tags to match them.
    for s in range(p - 1):
        up_sent = [m_.action.micro for m_ in sched.sends(s) if m_.peer == s + 1]
        up_received = [m_.action.micro for m_ in sched.messages(s + 1) if m_.direction == "recv" and m_.peer == s]
        down_sent = [m_.action.micro for m_ in sched.sends(s + 1) if m_.peer == s]
        down_received = [m_.action.micro for m_ in sched.messages(s) if m_.direction == "recv" and m_.peer == s + 1]
        assert up_sent == up_received == list(range(m))
        assert down_sent == down_received == list(range(m))
