"""`spopp learner ...`: the learner's sub-commands (also `python -m services.learner.cli`, which
torchrun runs once per rank)."""

from __future__ import annotations

from pathlib import Path

import click

from services.config.learner import LearnerSettings
from spopp.settings.base import settings_command


def _finished_already(settings: LearnerSettings) -> bool:
    """Whether the tracker says the run is finished: then there is nothing to train, and the
    learner exits 0 before it loads anything (a restarted or relaunched learner, a resume)."""
    import logging

    from spopp.api.client import TrackerClient

    with TrackerClient(settings.tracker, token=settings.api_token) as tracker:
        run = tracker.get_run(settings.run)
    if run.status != "finished":
        return False
    logging.getLogger("spopp.learner").info(
        "run %s is finished at version %d: nothing to train", settings.run, run.final_version
    )
    return True


def _run(settings: LearnerSettings, nproc: int, resume: bool) -> None:
    import os

    from services.shell.logs import setup_logging

    from . import ranks

    rank = os.environ.get("RANK") if ranks.is_rank() else None  # torchrun's rank of this process
    setup_logging("learner", settings.log_format, run=settings.run, rank=rank)
    if ranks.is_rank():
        ranks.die_with_launcher()
    if _finished_already(settings):
        return
    if not ranks.is_rank() and nproc > 1:
        ranks.relaunch(settings, nproc, resume)  # does not return
    from .trainer import Learner

    Learner(settings, resume=resume).run()


_RESUME_HELP = (
    "continue from the newest checkpoint under `checkpoints` (weights, optimizer, step, policy "
    "version, RNG, buffered trajectories); with no checkpoint there, start fresh"
)

group = click.Group("learner", help="The learner: DeepSpeed updates, snapshots, the policy clock.")
group.add_command(
    settings_command(
        LearnerSettings,
        "run",
        _run,
        help="Train on the first trajectories of each policy version; publish snapshots to the tracker.",
        extra_params=[
            click.Option(
                ["--nproc"],
                type=click.IntRange(1, 1024),
                default=1,
                show_default=True,
                help="processes on this node (relaunches under torchrun)",
            ),
            click.Option(["--resume"], is_flag=True, help=_RESUME_HELP),
        ],
    )
)


@group.command("plan")
@click.option(
    "--model", "model", required=True, help="a model folder or its config.json (no weights are read)"
)
@click.option("--gpus", type=click.IntRange(1, 100_000), required=True, help="GPUs the learner runs on")
@click.option("--zero", type=click.IntRange(0, 3), default=None, help="one ZeRO stage (default: every one)")
@click.option(
    "--micro-batch-tokens", type=click.IntRange(1, 1 << 24), default=4096, show_default=True,
    help="tokens per micro-batch (the learner's micro_batch_tokens: real tokens when packed, rows x longest when padded)",
)  # fmt: skip
@click.option(
    "--gpu-memory", type=click.FloatRange(1, 10_000), default=80.0, show_default=True, help="GiB per GPU"
)
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True)
@click.option(
    "--liger", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
    help="plan for liger-kernel's kernels (the learner's setting liger; auto: where the model's family is one it patches)",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="print the plan as JSON")
def plan_command(model: str, gpus: int, zero: int | None, micro_batch_tokens: int, gpu_memory: float, dtype: str,
                 liger: str, as_json: bool) -> None:  # fmt: skip
    """Per-GPU memory of training MODEL on GPUS (weights, gradients, optimizer states, activations),
    with and without checkpointing and offload, and which settings fit. Reads config.json only."""
    from . import memory_plan

    if zero == 0 and dtype == "bf16":
        raise click.BadParameter(
            "ZeRO 0 with bf16 is refused by the learner (see zero_stage); use 1", param_hint="--zero"
        )
    try:
        shape = memory_plan.model_shape(memory_plan.read_config(model))
    except (OSError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    from .kernels import family_not_patched

    # The learner on a GPU applies liger where its image has it (the GPU learner image does) and
    # the family is one it patches (kernels.why_not); the plan has no device to ask.
    reason = family_not_patched(shape.model_type)
    if liger == "on" and reason is not None:
        raise click.BadParameter(reason, param_hint="--liger")
    settings = {
        "gpus": gpus, "gpu_memory_gib": gpu_memory, "tokens": micro_batch_tokens, "dtype": dtype,
        "liger": liger != "off" and reason is None,
    }  # fmt: skip
    rows = memory_plan.plan(shape, zero=zero, **settings)
    click.echo(
        memory_plan.as_json(shape, rows, **settings)
        if as_json
        else memory_plan.render(shape, rows, **settings)
    )


lora_group = click.Group("lora", help="LoRA snapshots: adapters the learner published (lora_rank > 0).")


@lora_group.command("merge")
@click.argument("snapshot", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), required=True, help="the new folder (must not exist)")
@click.option(
    "--base", type=click.Path(path_type=Path), default=None,
    help="the base model folder (default: the snapshot manifest's base_model)",
)  # fmt: skip
def lora_merge_command(snapshot: Path, out: Path, base: Path | None) -> None:
    """Merge an adapter SNAPSHOT into its base model: a Hugging Face folder (full weights, the
    base's config and tokenizer) that vLLM and transformers load as any model."""
    from spopp.files.adapters import merge_adapter_folder

    try:
        folder = merge_adapter_folder(snapshot, out, base)
    except (OSError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"merged {snapshot} into {folder}")


if __name__ == "__main__":
    group(prog_name="spopp learner")
