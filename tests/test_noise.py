"""Library noise quieted once per process (pretrainer/noise.py): a repeated torch FutureWarning shown once even
though the step's code resets the warning registries, DeepSpeed's CPU-detection notice dropped, others untouched."""

import logging
import warnings

from pretrainer import noise

COLLECTIVE = "`torch.distributed.all_gather_into_tensor` is deprecated. Please use `all_gather_single` instead."


def test_a_known_warning_once_per_process_across_registry_resets():
    shown = []
    show = noise._once_per_text(lambda message, *a, **k: shown.append(str(message)))
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = show
        for _ in range(50):  # as inside DeepSpeed's step: each catch_warnings clears the "already shown" registries
            with warnings.catch_warnings():
                pass
            warnings.warn(COLLECTIVE, FutureWarning, stacklevel=1)
            warnings.warn("something else", FutureWarning, stacklevel=1)
    assert shown.count(COLLECTIVE) == 1
    assert shown.count("something else") == 50  # what is not on the list keeps Python's own behaviour


def test_deepspeed_cpu_notice_dropped():
    noise.quiet_library_noise()
    noise.quiet_library_noise()  # idempotent: one filter, not two
    logger = logging.getLogger("DeepSpeed")
    record = logging.LogRecord(
        "DeepSpeed", logging.WARNING, __file__, 1, "Setting accelerator to CPU. If you", (), None
    )
    other = logging.LogRecord("DeepSpeed", logging.WARNING, __file__, 1, "ZeRO stage 3 enabled", (), None)
    assert not logger.filter(record) and logger.filter(other)
    assert len([f for f in logger.filters if isinstance(f, noise._Drop)]) == 1


def test_torch_elastic_failure_line_dropped_for_a_preemption_only():
    noise.quiet_preempted_ranks()
    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    template = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"

    def record(code):
        return logging.LogRecord(logger.name, logging.ERROR, __file__, 1, template, (code, 0, 123, "python"), None)

    assert not logger.filter(record(75))  # saved and stopped as asked: the rank said so in one line
    assert logger.filter(record(1)) and logger.filter(record(2))  # a crash or bad input stays
