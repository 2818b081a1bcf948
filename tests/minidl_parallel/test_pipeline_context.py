"""pipeline_stages and pipeline_config in the auto-parallel context (MindSpore 2.10's keys): checked
when set, reset, read; and what the pipeline reads at use: pipeline_settings() (the mode) and
stage_layout() (MindSpore's rank order). MindSpore's own answers, where quoted, were read from
MindSpore 2.10.0's set_auto_parallel_context."""
import pytest

import minidl_parallel as mp
from minidl_parallel import ParallelMode, run_threads
from minidl_parallel.context import pipeline_settings, stage_layout
from minidl_parallel.pipeline import SCHEDULERS

DEFAULT_CONFIG = {"pipeline_interleave": False, "pipeline_scheduler": "1f1b"}
WHO = "set_auto_parallel_context"


@pytest.fixture(autouse=True)
def _clean():
    mp.release()
    mp.reset_auto_parallel_context()
    yield
    mp.release()
    mp.reset_auto_parallel_context()


def _raises(error, message, **kwargs):
    """set_auto_parallel_context(**kwargs) raises ``error`` with exactly ``message``, and changes nothing."""
    before = {key: mp.get_auto_parallel_context(key) for key in ("pipeline_stages", "pipeline_config")}
    with pytest.raises(error) as info:
        mp.set_auto_parallel_context(**kwargs)
    assert str(info.value) == message
    assert {key: mp.get_auto_parallel_context(key) for key in before} == before


# --- pipeline_stages ----------------------------------------------------------------------------

def test_defaults_and_reset():
    assert mp.get_auto_parallel_context("pipeline_stages") == 1
    assert mp.get_auto_parallel_context("pipeline_config") == DEFAULT_CONFIG
    # MindSpore's read keys for the config's entries
    assert mp.get_auto_parallel_context("pipeline_interleave") is False
    assert mp.get_auto_parallel_context("pipeline_scheduler") == "1f1b"
    mp.set_auto_parallel_context(pipeline_stages=4, pipeline_config={"pipeline_scheduler": "gpipe"})
    assert mp.get_auto_parallel_context("pipeline_stages") == 4
    assert mp.get_auto_parallel_context("pipeline_scheduler") == "gpipe"
    mp.reset_auto_parallel_context()
    assert mp.get_auto_parallel_context("pipeline_stages") == 1
    assert mp.get_auto_parallel_context("pipeline_config") == DEFAULT_CONFIG


@pytest.mark.parametrize("mode", ParallelMode.MODES)
def test_pipeline_stages_is_accepted_in_every_mode_in_either_order(mode):
    """As in MindSpore 2.10 (which accepts it even in stand_alone and data_parallel): the mode is
    checked when the pipeline runs, so the two may be set in any order."""
    mp.set_auto_parallel_context(pipeline_stages=2)
    mp.set_auto_parallel_context(parallel_mode=mode)
    assert mp.get_auto_parallel_context("pipeline_stages") == 2
    mp.reset_auto_parallel_context()
    mp.set_auto_parallel_context(parallel_mode=mode, pipeline_stages=3)
    assert (mp.get_auto_parallel_context("parallel_mode"), mp.get_auto_parallel_context("pipeline_stages")) == (mode, 3)


@pytest.mark.parametrize("value, error, message", [
    # MindSpore: TypeError "... 'pipeline_stages' must be int, but got the type : <class 'bool'>."
    (True, TypeError, f"{WHO}: pipeline_stages must be an int >= 1, got bool True"),
    (False, TypeError, f"{WHO}: pipeline_stages must be an int >= 1, got bool False"),
    # MindSpore: ValueError "... 'pipeline_stages' should be greater or equal 1, but got the value of stages : 0."
    (0, ValueError, f"{WHO}: pipeline_stages must be an int >= 1, got 0"),
    (-1, ValueError, f"{WHO}: pipeline_stages must be an int >= 1, got -1"),
    # MindSpore: TypeError "The parameter 'pipeline_stages' must be <class 'int'>, but got <class 'str'>"
    ("2", TypeError, f"{WHO}: pipeline_stages must be an int >= 1, got str '2'"),
    (2.0, TypeError, f"{WHO}: pipeline_stages must be an int >= 1, got float 2.0"),
    (None, TypeError, f"{WHO}: pipeline_stages must be an int >= 1, got NoneType None"),
])
def test_pipeline_stages_refuses_what_is_not_an_int_of_at_least_one(value, error, message):
    _raises(error, message, pipeline_stages=value)


# --- pipeline_config ----------------------------------------------------------------------------

@pytest.mark.parametrize("config, expected", [
    (DEFAULT_CONFIG, DEFAULT_CONFIG),
    ({"pipeline_interleave": False, "pipeline_scheduler": "gpipe"},
     {"pipeline_interleave": False, "pipeline_scheduler": "gpipe"}),  # MindSpore refuses it without interleave
    ({"pipeline_scheduler": "gpipe"}, {"pipeline_interleave": False, "pipeline_scheduler": "gpipe"}),
])
def test_pipeline_config_accepts_both_schedulers_without_interleave(config, expected):
    other = "gpipe" if expected["pipeline_scheduler"] == "1f1b" else "1f1b"
    mp.set_auto_parallel_context(pipeline_config={"pipeline_scheduler": other})  # the next set must replace it
    mp.set_auto_parallel_context(pipeline_config=config)
    assert mp.get_auto_parallel_context("pipeline_config") == expected
    assert mp.get_auto_parallel_context("pipeline_scheduler") == expected["pipeline_scheduler"]
    assert expected["pipeline_scheduler"] in SCHEDULERS


@pytest.mark.parametrize("config, error, message", [
    # MindSpore: TypeError "The parameter 'pipeline_config' must be <class 'dict'>, but got <class 'list'>"
    ([("pipeline_scheduler", "1f1b")], TypeError,
     f"{WHO}: pipeline_config must be a dict with keys ('pipeline_interleave', 'pipeline_scheduler'), e.g. "
     f"{DEFAULT_CONFIG}, got list [('pipeline_scheduler', '1f1b')]"),
    # MindSpore: ValueError "Unknown config: ['micro']"
    ({"pipeline_scheduler": "1f1b", "micro": 2}, ValueError,
     f"{WHO}: pipeline_config has unknown key(s) ['micro']; valid keys are "
     f"('pipeline_interleave', 'pipeline_scheduler')"),
    # MindSpore: a bare KeyError "'pipeline_scheduler'"
    ({"pipeline_interleave": False}, ValueError,
     f"{WHO}: pipeline_config is missing the key 'pipeline_scheduler' (one of ('1f1b', 'gpipe')); valid keys "
     f"are ('pipeline_interleave', 'pipeline_scheduler'), e.g. {DEFAULT_CONFIG}"),
    ({}, ValueError,
     f"{WHO}: pipeline_config is missing the key 'pipeline_scheduler' (one of ('1f1b', 'gpipe')); valid keys "
     f"are ('pipeline_interleave', 'pipeline_scheduler'), e.g. {DEFAULT_CONFIG}"),
    # MindSpore: TypeError "For 'pipeline_interleave', the 'pipeline_interleave' must be a bool, but got int."
    ({"pipeline_interleave": 1, "pipeline_scheduler": "1f1b"}, TypeError,
     f"{WHO}: pipeline_config['pipeline_interleave'] must be True or False, got 1"),
    # MindSpore accepts it (its interleaved scheduler); minidl runs one stage per rank
    ({"pipeline_interleave": True, "pipeline_scheduler": "1f1b"}, ValueError,
     f"{WHO}: pipeline_config['pipeline_interleave'] is True: interleaved pipelines (several virtual stages "
     f"per rank) are not built in minidl; each rank runs one stage, so use False"),
    # MindSpore: ValueError "The 'parameter' must be str and must be in '['1f1b', 'gpipe', ...]', but got '1F1B'."
    ({"pipeline_scheduler": "1F1B"}, ValueError,
     f"{WHO}: pipeline_config['pipeline_scheduler'] must be one of ('1f1b', 'gpipe') (names are lowercase, as "
     f"MindSpore's: use '1f1b'), got '1F1B'"),
    ({"pipeline_scheduler": "seqpipe"}, ValueError,
     f"{WHO}: pipeline_config['pipeline_scheduler'] must be one of ('1f1b', 'gpipe') (the schedulers minidl "
     f"builds), got 'seqpipe'"),
    ({"pipeline_interleave": False, "pipeline_scheduler": 3}, TypeError,
     f"{WHO}: pipeline_config['pipeline_scheduler'] must be one of ('1f1b', 'gpipe'), got int 3"),
])
def test_pipeline_config_errors_name_the_key_the_value_and_what_is_expected(config, error, message):
    _raises(error, message, pipeline_config=config)


def test_a_bad_pipeline_config_leaves_every_setting_of_the_call_unset():
    with pytest.raises(ValueError):
        mp.set_auto_parallel_context(pipeline_stages=2, parallel_mode=ParallelMode.SEMI_AUTO_PARALLEL,
                                     pipeline_config={"pipeline_scheduler": "GPipe"})
    assert mp.get_auto_parallel_context("pipeline_stages") == 1
    assert mp.get_auto_parallel_context("parallel_mode") == ParallelMode.STAND_ALONE


def test_the_config_read_back_is_a_copy():
    config = mp.get_auto_parallel_context("pipeline_config")
    config["pipeline_scheduler"] = "gpipe"
    assert mp.get_auto_parallel_context("pipeline_scheduler") == "1f1b"
    given = {"pipeline_scheduler": "gpipe"}
    mp.set_auto_parallel_context(pipeline_config=given)
    given["pipeline_scheduler"] = "1f1b"  # the caller's dict is not the setting either
    assert mp.get_auto_parallel_context("pipeline_scheduler") == "gpipe"


@pytest.mark.parametrize("key", ["pipeline_scheduler", "pipeline_interleave"])
def test_the_config_entries_are_read_but_not_set_under_their_own_names(key):
    # MindSpore: ValueError "Set context keyword pipeline_scheduler is not recognized!"
    _raises(ValueError, f"{WHO}: {key!r} is set through pipeline_config (as in MindSpore), e.g. "
                        f"pipeline_config={DEFAULT_CONFIG}", **{key: "gpipe"})


# --- at use: the mode, the layout ---------------------------------------------------------------

@pytest.mark.parametrize("mode", ParallelMode.MODES)
def test_one_stage_is_no_pipeline_and_fits_every_mode(mode):
    mp.set_auto_parallel_context(parallel_mode=mode)
    assert pipeline_settings() == (1, "1f1b")


@pytest.mark.parametrize("mode", [ParallelMode.STAND_ALONE, ParallelMode.DATA_PARALLEL])
def test_stages_need_semi_auto_or_auto_parallel_when_the_pipeline_runs(mode):
    mp.set_auto_parallel_context(parallel_mode=mode, pipeline_stages=2)  # setting it is fine
    with pytest.raises(RuntimeError) as info:
        pipeline_settings()
    assert str(info.value) == (
        f"pipeline_stages is 2, which needs parallel_mode one of ('semi_auto_parallel', 'auto_parallel') (as in "
        f"MindSpore), got parallel_mode {mode!r}: call "
        f"set_auto_parallel_context(parallel_mode=ParallelMode.SEMI_AUTO_PARALLEL)")


@pytest.mark.parametrize("mode", [ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.AUTO_PARALLEL])
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_pipeline_settings_give_the_stages_and_the_scheduler(mode, scheduler):
    mp.set_auto_parallel_context(pipeline_stages=4, pipeline_config={"pipeline_scheduler": scheduler})
    mp.set_auto_parallel_context(parallel_mode=mode)  # after the stages: the order does not matter
    assert pipeline_settings() == (4, scheduler)


@pytest.mark.parametrize("world_size, rank, stages, expected", [
    # MindSpore's DeviceManager: 8 devices, 2 stages -> stages [[0, 1, 2, 3], [4, 5, 6, 7]]; a rank's
    # pipeline group is rank + k * (i - its stage) for each stage i
    (8, 0, 2, (0, (0, 1, 2, 3), (0, 4))),
    (8, 5, 2, (1, (4, 5, 6, 7), (1, 5))),
    (8, 5, 4, (2, (4, 5), (1, 3, 5, 7))),
    (4, 3, 4, (3, (3,), (0, 1, 2, 3))),
    (4, 2, 1, (0, (0, 1, 2, 3), (2,))),
    (6, 4, 3, (2, (4, 5), (0, 2, 4))),
    (1, 0, 1, (0, (0,), (0,))),
])
def test_stage_layout_follows_mindspore_rank_order(world_size, rank, stages, expected):
    assert stage_layout(world_size, rank, stages) == expected


def test_stage_layout_partitions_the_world_into_stages_and_pipeline_groups():
    for world_size in range(1, 9):
        for stages in (s for s in range(1, world_size + 1) if world_size % s == 0):
            layouts = [stage_layout(world_size, r, stages) for r in range(world_size)]
            stage_sets = {ranks for _, ranks, _ in layouts}
            pipe_sets = {ranks for _, _, ranks in layouts}
            assert sorted(r for ranks in stage_sets for r in ranks) == list(range(world_size))
            assert sorted(r for ranks in pipe_sets for r in ranks) == list(range(world_size))
            for rank, (stage, stage_ranks, pipeline_ranks) in enumerate(layouts):
                assert rank in stage_ranks and pipeline_ranks[stage] == rank
                # one rank per stage, in stage order
                assert [stage_layout(world_size, r, stages)[0] for r in pipeline_ranks] == list(range(stages))


def test_stage_layout_reads_the_setting_when_not_given_stages():
    mp.set_auto_parallel_context(pipeline_stages=2)
    assert stage_layout(4, 1) == (0, (0, 1), (1, 3))


@pytest.mark.parametrize("world_size, rank, stages, message", [
    (6, 0, 4, "pipeline_stages is 4, which does not divide the world size 6: each stage runs on "
              "world_size // pipeline_stages ranks; expected pipeline_stages one of (1, 2, 3, 6), or a world size "
              "that is a multiple of 4"),
    (2, 0, 4, "pipeline_stages is 4, which does not divide the world size 2: each stage runs on "
              "world_size // pipeline_stages ranks; expected pipeline_stages one of (1, 2), or a world size "
              "that is a multiple of 4"),
    (4, 4, 2, "pipeline layout: rank must be an int in [0, 3], got 4"),
    (4, -1, 2, "pipeline layout: rank must be an int in [0, 3], got -1"),
    (0, 0, 1, "pipeline layout: world_size must be an int >= 1, got 0"),
    (4, 0, True, "pipeline layout: pipeline_stages must be an int >= 1, got True"),
])
def test_stage_layout_errors_name_the_values_and_what_is_expected(world_size, rank, stages, message):
    with pytest.raises(ValueError) as info:
        stage_layout(world_size, rank, stages)
    assert str(info.value) == message


def test_each_thread_rank_resolves_its_own_settings_at_use():
    """Under the threads world each rank has its own settings; the layout comes from the world's size."""
    def body():
        mp.set_auto_parallel_context(pipeline_stages=2, parallel_mode=ParallelMode.SEMI_AUTO_PARALLEL)
        stages, scheduler = pipeline_settings()
        return stages, scheduler, stage_layout(mp.get_group_size(), mp.get_rank())

    assert run_threads(4, body, timeout=20) == [(2, "1f1b", (0, (0, 1), (0, 2))), (2, "1f1b", (0, (0, 1), (1, 3))),
                                                (2, "1f1b", (1, (2, 3), (0, 2))), (2, "1f1b", (1, (2, 3), (1, 3)))]
    assert mp.get_auto_parallel_context("pipeline_stages") == 1  # the main thread's settings are its own


def test_the_mode_names_pipeline_config_checks_are_parallel_modes():
    """pipeline_config.py cannot import context.py (context.py imports it), so it writes the two modes out."""
    from minidl_parallel.pipeline_config import PIPELINE_MODES
    assert PIPELINE_MODES == (ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.AUTO_PARALLEL)
