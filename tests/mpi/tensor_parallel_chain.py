"""Run under mpirun: random sharded chains (a JSON file of cases) equal the single-device run.

Each case is (layers, loss, mode, dataset_strategy, features) as drawn by
tests/minidl_parallel/tensor_parallel/test_equivalence.py. Every rank computes the
single-device reference alone, then the sharded run on the mpi backend, and compares the
gathered results in float64 to 1e-10 relative; prints ``rank r: ok`` or exits 1.
"""
import json
import sys

import minidl_parallel as mp
from minidl_parallel.testing import compare_runs, run_rank, run_single


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _case(layers, loss, mode, dataset, features):
    for spec in layers + [loss]:
        if spec.get("strategy") is not None:
            spec["strategy"] = _tuples(spec["strategy"])
    return layers, loss, mode, dataset, features


def main(path):
    sys.path.insert(0, "tests/minidl_parallel/tensor_parallel")
    from test_equivalence import make_data
    mp.init("mpi")
    with open(path) as f:
        cases = [_case(*c) for c in json.load(f)]
    for i, (layers, loss, mode, dataset, features) in enumerate(cases):
        data = make_data(layers, loss, features)
        ref = run_single(layers, loss, data)
        got = run_rank(layers, loss, data, mode, 2, 0.05, dataset)
        try:
            compare_runs(got, ref)
        except AssertionError as e:
            print(f"rank {mp.get_rank()}: case {i} {cases[i]} differs: {e}", flush=True)
            sys.exit(1)
    print(f"rank {mp.get_rank()}: ok", flush=True)
    mp.release()


if __name__ == "__main__":
    main(sys.argv[1])
