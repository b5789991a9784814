"""Example: report Hugging Face ``Trainer`` progress to powerflexd.

Put this file beside ``powerflex_progress.py`` on the job's ``PYTHONPATH``:

    from hf_callback_example import PowerflexCallback

    seq_len = 2048
    global_batch = (args.per_device_train_batch_size * args.gradient_accumulation_steps
                    * args.world_size)
    trainer = Trainer(..., callbacks=[PowerflexCallback(tokens_per_step=global_batch * seq_len)])

Without ``tokens_per_step`` only optimizer steps are reported, which is enough
for the agent to compare throughput under different power caps.
"""

from transformers import TrainerCallback

from powerflex_progress import ProgressReporter


class PowerflexCallback(TrainerCallback):
    """Reports each optimizer step (and its tokens) from the local main process."""

    def __init__(self, tokens_per_step=0, min_interval_s=1.0):
        self.tokens_per_step = int(tokens_per_step)
        # Connects lazily, so ranks that never report never open a socket.
        self.reporter = ProgressReporter(min_interval_s=min_interval_s)

    def on_step_end(self, args, state, control, **kwargs):
        # One reporter per node: the agent keeps a single counter per job.
        if state.is_local_process_zero:
            self.reporter.add(tokens=self.tokens_per_step, steps=1)

    def on_train_end(self, args, state, control, **kwargs):
        # The last steps since the previous rate-limited report.
        if state.is_local_process_zero:
            self.reporter.flush()
