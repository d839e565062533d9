"""What the command line and `describe_mesh` tell a person: the stop message says how many
steps still run, a mixture of experts' header says what the progress line's ``dropped`` share
is, and a CPU mesh's description lists only the XLA settings that apply on a CPU. (gloo's
connection lines: tests/test_output_guard.py and tests/test_multiprocess.py.)"""

from __future__ import annotations

import os
import signal

import pytest

import gtp_jax
from gtp_jax.base import xla_flags
from gtp_jax.train import TrainConfig
from gtp_jax.train.config import describe_choices, model_config
from gtp_jax.train.lifecycle.preempt import stop_on_signals


def test_the_stop_message_says_at_most_two_more_steps(capfd: pytest.CaptureFixture[str]):
    with stop_on_signals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
    assert stop.requested
    err = capfd.readouterr().err
    assert err.count("\n") == 1, err
    assert "SIGINT received: finishing at most two more steps" in err
    assert "the host runs one step ahead" in err and "saving a checkpoint" in err
    with stop_on_signals(saves=False):  # no checkpoint directory: no save announced
        os.kill(os.getpid(), signal.SIGINT)
    err = capfd.readouterr().err
    assert "then exiting (no checkpoint directory: nothing is saved)" in err, err
    assert "saving a checkpoint" not in err


@pytest.mark.parametrize("capacity,says", [
    (1.25, "capacity 1.25x an even share per expert: routing choices beyond it are dropped "
           "(the progress line's 'dropped' share; --moe-capacity 0 is dropless)"),
    (None, "dropless (every routing choice computed)"),
])
def test_a_mixture_of_experts_header_explains_the_dropped_share(capacity, says):
    cfg = TrainConfig(moe_experts=4, moe_capacity_factor=capacity, dp=2, gtp=4, batch_size=8,
                      seq_len=32)
    line = describe_choices(cfg, model_config(cfg))
    assert "MoE 4 experts, top-2, " + says in line
    dense = TrainConfig(dp=2, gtp=4, batch_size=8, seq_len=32)
    assert "MoE" not in describe_choices(dense, model_config(dense))


def test_a_cpu_mesh_lists_only_the_settings_that_apply_on_cpus(monkeypatch):
    gpu_only = ["--xla_gpu_enable_latency_hiding_scheduler=true",
                f"{xla_flags.PINNED_POOL_ENV}=21"]
    monkeypatch.setattr(xla_flags, "_ADDED", [*gpu_only, "--xla_cpu_example=true"])
    monkeypatch.delenv(xla_flags.OPT_OUT, raising=False)
    lines: list[str] = []
    gtp_jax.describe_mesh(gtp_jax.make_mesh(dp=2, gtp=4), print_fn=lines.append)
    assert lines[-1] == ("  XLA settings added by gtp_jax: --xla_cpu_example=true (opt out: "
                         "GTP_JAX_NO_DEFAULT_XLA_FLAGS=1)"), lines
    # On GPUs all but the CPU's apply; on a CPU with only GPU settings added, it says so.
    assert all(s in xla_flags.describe_xla_flags("gpu") for s in gpu_only)
    assert "--xla_cpu_example" not in xla_flags.describe_xla_flags("gpu")
    monkeypatch.setattr(xla_flags, "_ADDED", gpu_only)
    assert xla_flags.describe_xla_flags("cpu") == (
        "XLA settings: none of gtp_jax's apply on cpu (they are for GPUs)")
