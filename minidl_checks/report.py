"""What the GPU check prints: the versions, one line per stage, and the row for docs/gpu.md's
results table."""
from .probe import find_mpirun


def print_versions(probe):
    lines = [f"Python {probe.get('python')} ({probe.get('python_exe')})", f"NumPy {probe.get('numpy')}",
             f"minidl {probe.get('minidl')}", f"platform {probe.get('platform')}"]
    if probe.get("gpu_reason") is None:
        lines.append(f"CuPy {probe.get('cupy')}, CUDA runtime {probe.get('cuda_runtime')}, driver supports CUDA "
                     f"{probe.get('cuda_driver')}")
        for i, g in enumerate(probe.get("gpus", [])):
            lines.append(f"GPU {i}: {g['name']}, {g['memory_gib']} GiB, compute capability {g['capability']}")
        if probe.get("cuda_visible_devices") is not None:
            lines.append(f"CUDA_VISIBLE_DEVICES={probe['cuda_visible_devices']}")
    else:
        cupy = "CuPy: not installed"
        if probe.get("cupy_installed"):
            cupy = f"CuPy {probe.get('cupy') or '(version unknown)'}"
        lines.append(f"{cupy}; no GPU for minidl: {probe.get('gpu_reason')}")
    lines.append(f"mpi4py {probe['mpi4py']}" if probe.get("mpi4py") else "mpi4py: not installed")
    lines.append(f"PyTorch {probe['torch']}" if probe.get("torch") else "PyTorch: not installed")
    lines.append(f"mpirun: {find_mpirun() or 'not found'}")
    print("versions:\n  " + "\n  ".join(lines), flush=True)


def print_result(res):
    tag = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}[res.status]
    took = f" ({res.seconds:.1f} s)" if res.status != "skipped" else ""
    print(f"[{tag}] {res.name}{took}: {res.summary}", flush=True)
    if res.status == "failed" and res.output_tail:
        print("  | " + res.output_tail.replace("\n", "\n  | "), flush=True)


def _cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_row(date, probe, results, nothing_reason=None):
    """The row for docs/gpu.md's results table: | date | GPU | what ran | result |."""
    if nothing_reason is not None:
        failed = any(r.status == "failed" for r in results)
        verdict = ("FAILED: CuPy is installed but cannot use a GPU; " if failed else "") + \
            "nothing on the GPU was checked"
        return f"| {date} | none | `python -m minidl.gpu_check`: {_cell(nothing_reason)} | {verdict} |"
    gpus = probe.get("gpus", [])
    names = sorted({g["name"] for g in gpus})
    gpu = (f"{len(gpus)}x {', '.join(names)} (CUDA runtime {probe.get('cuda_runtime')}, driver "
           f"{probe.get('cuda_driver')}, CuPy {probe.get('cupy')}")
    nccl = next((r.data.get("nccl") for r in results if r.name == "libs" and r.data.get("nccl")), None)
    gpu += f", NCCL {nccl})" if nccl else ")"
    ran = [r.name for r in results if r.status != "skipped"]
    skipped_ = [f"{r.name} ({r.summary})" for r in results if r.status == "skipped"]
    what = "`python -m minidl.gpu_check`: " + ", ".join(ran)
    if skipped_:
        what += "; skipped: " + "; ".join(skipped_)
    failed = [r.name for r in results if r.status == "failed"]
    passed = [r.name for r in results if r.status == "passed"]
    verdict = f"FAILED: {', '.join(failed)}" if failed else f"all {len(passed)} passed"
    details = [r.summary for r in results if r.name in ("resnet20", "bench", "bench-torch") and r.status == "passed"]
    result = "; ".join([verdict, *details])
    return f"| {date} | {_cell(gpu)} | {_cell(what)} | {_cell(result)} |"
