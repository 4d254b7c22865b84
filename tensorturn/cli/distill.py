"""From an ensemble to one model: ``tensorturn distill`` (a student trained on the pool against the
vote) and ``tensorturn soup`` (members fine-tuned from one model, averaged)."""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any

import click

from tensorturn.cli import cli, pool_options
from tensorturn.cli.run import (
    TRAINING,
    Stage,
    bounded,
    follow_options,
    launch,
    mode_options,
    print_results,
    training_options,
)
from tensorturn.errors import SpecError

TEMPERATURE, ALPHA, TOP_K, MIXUP = 2.0, 0.5, 16, 0
# the fused run's defaults for a student (FusedOptions' own suit training from scratch on
# many machines): about the ensemble's own training budget, in few long rounds
ROUNDS, SYNC_EVERY = 24, 100


def parse_student(text: str | None) -> dict[str, Any]:
    """``--student``: a JSON object of model settings, or ``@path`` to a file holding one."""
    if text is None:
        return {}
    source = "--student"
    if text.startswith("@"):
        path = Path(text[1:])
        try:
            text = path.read_text()
        except OSError as exc:
            raise SpecError(f"--student {text}: cannot read {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise SpecError(f"--student {text}: {path} is not UTF-8 text (a JSON object of model "
                            f"settings)") from None
        source = f"--student file {path}"
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise SpecError(f"{source} is not JSON ({exc}); give an object such as '{{\"hidden\": [64]}}'") from None
    if not isinstance(value, dict):
        raise SpecError(f"{source} must be a JSON object of model settings (got {type(value).__name__})")
    return value


def distill_spec(teacher: str, store: str, run_id: str = "", student: dict[str, Any] | None = None,
                 temperature: float = TEMPERATURE, alpha: float = ALPHA, top_k: int = TOP_K,
                 mixup: int = MIXUP, **options: Any) -> Any:
    """The fused run that distills ensemble ``teacher``: its recipe is ``distill`` over the
    ensemble's (checked now: a finished ensemble, a student that fits the data). Fused options
    not given take the student's defaults (ROUNDS, SYNC_EVERY, and the shards any fused run gets:
    :func:`tensorturn.modes.fused.default_shards`)."""
    from tensorturn.modes.fused import default_shards
    from tensorturn.recipes import resolve
    from tensorturn.recipes.check import check_contract
    from tensorturn.recipes.distilled import plan
    from tensorturn.runs import service as client
    from tensorturn.spec import RunSpec, check_bounds
    from tensorturn.store.objects import open_store

    check_bounds({"temperature": temperature, "alpha": alpha, "top_k": top_k, "mixup": mixup})
    recipe_options = plan(open_store(store), teacher, student, temperature, alpha, top_k, mixup)
    recipe = resolve("distill", recipe_options)
    check_contract(recipe_options["recipe"], recipe, "nothing was queued")  # the ensemble's, as it is now
    options = {k: v for k, v in options.items() if v is not None}
    options.setdefault("rounds", ROUNDS)
    # the command's choices, not the user's: the run warns about its shards' passes only for the user's
    options["chosen"] = [name for name in ("sync_every", "shards") if name not in options]
    options.setdefault("sync_every", SYNC_EVERY)
    if "shards" not in options:
        options["shards"] = default_shards(recipe.train_rows())
    spec = RunSpec.create("fused", "distill", store, recipe_options=recipe_options,
                          **({"run_id": run_id} if run_id else {}), **options)
    client.validate(spec)
    return spec


def check_distillable(recipe: str, recipe_options: dict[str, Any]) -> None:
    """``run --merge distill``: refuse, before the ensemble trains, a recipe whose ensemble
    could not be distilled (its kind), building it here — the user named it on this command."""
    from tensorturn import config, trust
    from tensorturn.recipes import resolve
    from tensorturn.recipes.distilled import DISTILLABLE

    config.use(trust.with_allowed(config.current(), [recipe]))
    task = resolve(recipe, recipe_options).task
    if task not in DISTILLABLE:
        raise SpecError(f"--merge distill: recipe {recipe!r} is a {task} recipe; distillation needs "
                        f"a classification or language-model ensemble (its vote is already the "
                        f"members' mean)")


def distill_stage(teacher: str, store: str, training: dict[str, Any], **settings: Any) -> Stage:
    """A stage of ``launch`` that distills ``teacher`` once it has finished (``run --merge``):
    its run id is chosen now, its spec built when the ensemble is done."""
    from tensorturn.runs import service as client
    from tensorturn.spec import new_run_id

    run_id = new_run_id()

    def start(broker_url: str) -> dict[str, Any]:
        spec = distill_spec(teacher, store, run_id=run_id, **settings, **training)
        click.echo(f"distilling ensemble {teacher} into one model: run {run_id}", err=True)
        return client.submit(spec, broker_url)

    return run_id, start


@cli.command()
@click.argument("teacher", metavar="RUN")
@click.option("--student", default=None, metavar="JSON|@FILE",
              help="The student's model settings, over the recipe's defaults: a JSON object "
                   "(e.g. '{\"hidden\": [64]}') or @path to a file holding one [default: the "
                   "recipe's default model, one member's inference cost].")
@click.option("--temperature", type=float, default=TEMPERATURE, show_default=True,
              help="Softens the members' distributions before they are averaged and matched "
                   "(Hinton et al. 2015); higher keeps more of what the vote says about wrong classes."
                   + bounded("temperature"))
@click.option("--alpha", type=float, default=ALPHA, show_default=True,
              help="Weight of the teacher's soft targets; 1 − alpha goes to the true labels."
                   + bounded("alpha"))
@click.option("--top-k", type=int, default=TOP_K, show_default=True,
              help="Classes (tokens) of the teacher's distribution kept per row, renormalised: "
                   "bounds the stored targets for large vocabularies."
                   + bounded("top_k"))
@click.option("--mixup", type=int, default=MIXUP, show_default=True,
              help="Mixed transfer rows per training row, real-valued inputs only: each a random "
                   "mix of two rows of its shard, labelled by the teacher alone."
                   + bounded("mixup"))
@mode_options("fused", defaults={"rounds": str(ROUNDS), "sync_every": f"{SYNC_EVERY} for a distillation"})
@training_options
@follow_options("distill")
def distill(broker, store, teacher, student, temperature, alpha, top_k, mixup, local_workers, detach,
            timeout_s, as_json, **options):
    """Distill a finished ensemble into one model, trained on the pool.

    RUN is an ensemble run that has succeeded. The student — the ensemble's recipe with its
    default model, or --student settings — trains as a fused run (sharded, averaged every
    --sync-every steps, requeued when a machine drops) to match the members' soft vote at
    --temperature, mixed with the true labels by --alpha. Each shard's teacher targets are
    computed once, by the first machine that trains it, and kept in the store. The result is an
    ordinary one-model run: `tensorturn serve` serves it, its manifest names the ensemble.

    \b
    Examples:
      tensorturn run --mode ensemble --recipe digits-mlp --members 4 --json   # → RUN
      tensorturn distill RUN --local-workers 2
      tensorturn distill RUN --student '{"hidden": [64]}' --temperature 4 --rounds 12
    """
    from tensorturn import config, trust
    from tensorturn.state.manifest import finished_ensemble
    from tensorturn.store.objects import open_store

    training = {k: options.pop(k) for k in TRAINING}
    given = {k: v for k, v in options.items() if v is not None}
    # the ensemble's recipe, as its manifest signed with the pool key names it: this user's own
    # (as `resume` allows a run's); anything else about the run is refused in one line below
    ensemble = finished_ensemble(open_store(store), teacher, "distillation")
    config.use(trust.with_allowed(config.current(), [glob.escape(str(ensemble.get("recipe")))]))
    spec = distill_spec(teacher, store, student=parse_student(student), temperature=temperature,
                        alpha=alpha, top_k=top_k, mixup=mixup, **training, **given)

    def start(broker_url: str) -> dict[str, Any]:
        from tensorturn.runs import service as client

        return client.submit(spec, broker_url)

    recipes = ["distill", spec.recipe_options["recipe"]]
    print_results(launch([(spec.run_id, start)], broker, store, local_workers, detach, timeout_s,
                         recipes), as_json)


@cli.command()
@click.argument("ensemble", metavar="RUN")
@click.option("--rule", type=click.Choice(["best", "greedy", "uniform"]), default="best", show_default=True,
              help="greedy: members join, best first, while the soup's validation score does not "
                   "drop (Wortsman et al. 2022); uniform: the mean of every member's weights; "
                   "best: whichever of the two scores higher on validation.")
@click.option("--eval-batches", type=int, default=None,
              help="Validation and test figures from at most this many forward passes "
                   f"[default: the whole split]{bounded('eval_batches')}.")
@click.option("--json", "as_json", is_flag=True, help="Print the soup's run as one JSON object.")
@pool_options("Unused: a soup is made here, from the store alone.")
def soup(broker, store, ensemble, rule, eval_batches, as_json):
    """Average an ensemble's members into one model (a weight soup), here, from the store.

    RUN must be a finished ensemble whose members were fine-tuned from one model
    (`run --mode ensemble --init-from MODEL_RUN`): only then is the average of their weights a
    model. The soup is stored as a new one-model run, served like a fused model; its manifest
    names the ensemble, the rule and the members in it. Other ensembles are refused with the
    reason (`tensorturn distill RUN` merges any ensemble, on the pool).

    \b
    Example:
      tensorturn run --mode fused --recipe digits-mlp --json                       # → BASE
      tensorturn run --mode ensemble --recipe digits-mlp --init-from BASE --json   # → RUN
      tensorturn soup RUN
    """
    from tensorturn.merge.soup import soup as make_soup
    from tensorturn.spec import check_bounds
    from tensorturn.store.objects import open_store

    check_bounds({"eval_batches": eval_batches})
    doc = make_soup(open_store(store), ensemble, rule, eval_batches)
    print_results([doc], as_json)
