"""Will it fit, and which layout is fastest: the layout planner.

`plan` enumerates the layouts of a training run on the present devices (mesh sizes over
dp/gtp/tp/cp/ep, remat, layer loop, gather format, optimizer offload), rejects those whose
closed-form memory bound exceeds the budget, compiles the others' training step ahead of
time for their exact peak memory (`compiled_memory`), and ranks the ones that fit by a
step time predicted from measured rates (`calibration`). ``python -m gtp_jax plan`` prints
the table; ``python -m gtp_jax train --plan auto`` trains with the top layout.
`plan_fitting` plans optimizer offload only for a run that fits no other way, and then
keeps on the device what fits of the optimizer state (`keep_what_fits`).
`plan_on_paper` ranks the layouts for GPUs that are not here without compiling anything
(closed-form memory, a stored calibration, nodes joined by a slower network: `Topology`;
``python -m gtp_jax plan --on-paper``). See docs/planning.md.
"""

from gtp_jax.plan.layout import Layout, PlanSpace, enumerate_layouts
from gtp_jax.plan.memory import (
    MemoryFigure,
    abstract_train_state,
    compiled_memories,
    compiled_memory,
)
from gtp_jax.plan.paper import load_calibration, memory_estimate, plan_on_paper
from gtp_jax.plan.planner import (
    Candidate,
    Plan,
    format_table,
    keep_on_device,
    keep_what_fits,
    plan,
    plan_fitting,
)
from gtp_jax.plan.timing import Calibration, Topology, calibration, measure, step_seconds
from gtp_jax.train.step.memory import memory_bound  # the trainer's refusal bound, used to prune

__all__ = ["Calibration", "Candidate", "Layout", "MemoryFigure", "Plan", "PlanSpace", "Topology",
           "abstract_train_state", "calibration", "compiled_memories", "compiled_memory",
           "enumerate_layouts", "format_table", "keep_on_device", "keep_what_fits",
           "load_calibration", "measure", "memory_bound", "memory_estimate", "plan",
           "plan_fitting", "plan_on_paper", "step_seconds"]
