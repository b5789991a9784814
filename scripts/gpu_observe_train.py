"""The training loop scripts/gpu-observe.sh runs as its job's process.

PyTorch on CUDA when ``import torch`` works and CUDA sees a GPU: a small two-layer
bf16 model, trained on random data, big enough to keep the GPU at high power. Otherwise
it says why and runs a CPU-only stand-in, labelled as such in every line it prints: a
little arithmetic and a sleep per step, no GPU work at all. Either way it reports
progress to powerflexd through the project's helper (agent/python/powerflex_progress.py,
``POWERFLEX_PROGRESS`` and ``SLURM_JOB_ID`` from the environment) and prints JSON lines:
one ``started`` after its first step, one ``done`` at the end.

It stops when the stop file appears (gpu-observe.sh creates it once it has read the
end of the run) or after ``--max-seconds``, whichever is first.

    gpu_observe_train.py --helper-dir DIR --stop-file FILE --max-seconds N
"""

import argparse
import json
import os
import sys
import time


def line(**fields):
    print(json.dumps(fields), flush=True)


def cuda_trainer():
    """A step function on CUDA, or why there is none."""
    try:
        import torch
    except Exception as e:  # ImportError, or a broken install
        return None, f"import torch failed ({type(e).__name__}: {e})"
    if not torch.cuda.is_available():
        return None, f"torch {torch.__version__} sees no CUDA GPU"
    device = torch.device("cuda")
    torch.manual_seed(0)
    width, batch = 4096, 8192
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width)
    ).to(device=device, dtype=torch.bfloat16)
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device=device, dtype=torch.bfloat16)
    target = torch.randn(batch, width, device=device, dtype=torch.bfloat16)

    def step():
        optimiser.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        optimiser.step()
        # The step is done when the GPU is: progress counts finished work only.
        torch.cuda.synchronize()
        return batch  # one "token" per row

    name = torch.cuda.get_device_name(0)
    return step, f"PyTorch {torch.__version__} on CUDA ({name}), bf16 MLP {width}x{width}, batch {batch}"


def cpu_stand_in():
    """A step that costs a millisecond of CPU and sleeps 50 ms: progress without GPU work
    and without taking a shared machine's CPU."""

    def step():
        total = 0
        for i in range(20_000):
            total += i * i
        time.sleep(0.05)
        return 512

    return step


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--helper-dir", required=True)
    p.add_argument("--stop-file", required=True)
    p.add_argument("--max-seconds", type=float, required=True)
    p.add_argument("--cpu-only", action="store_true",
                   help="skip the CUDA attempt (the simulated-GPU test path)")
    args = p.parse_args()
    sys.path.insert(0, args.helper_dir)
    from powerflex_progress import ProgressReporter

    if args.cpu_only:
        step, why = None, "asked for the CPU-only stand-in (--cpu-only)"
    else:
        step, why = cuda_trainer()
    if step is None:
        mode = "cpu-stand-in"
        label = f"CPU-only stand-in, NO GPU WORK: {why}"
        step = cpu_stand_in()
    else:
        mode, label = "cuda", why
    begun = time.monotonic()
    steps = tokens = 0
    with ProgressReporter() as reporter:
        while True:
            tokens_now = step()
            steps += 1
            tokens += tokens_now
            reporter.add(tokens=tokens_now, steps=1)
            if steps == 1:
                line(event="started", mode=mode, label=label, pid=os.getpid(),
                     reporting=reporter.enabled)
            if os.path.exists(args.stop_file):
                break
            if time.monotonic() - begun >= args.max_seconds:
                break
    seconds = time.monotonic() - begun
    line(event="done", mode=mode, label=label, pid=os.getpid(), steps=steps,
         tokens=tokens, seconds=round(seconds, 3),
         tokens_per_s=round(tokens / seconds, 1) if seconds > 0 else None)


if __name__ == "__main__":
    main()
