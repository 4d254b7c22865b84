"""From an ensemble to one model: ``tensorturn distill`` (a student trained on the pool against the
vote, :mod:`tensorturn.merge.distill`) and ``tensorturn soup`` (members fine-tuned from one model,
averaged, :mod:`tensorturn.merge.soup`)."""

from __future__ import annotations

import click

from tensorturn.cli import cli, pool_options
from tensorturn.cli.options import TRAINING, bounded, follow_options, mode_options, training_options
from tensorturn.cli.output import launched, print_results
from tensorturn.cli.track import track_options, tracking
from tensorturn.merge.distill import ALPHA, MIXUP, ROUNDS, SYNC_EVERY, TEMPERATURE, TOP_K


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
@track_options
def distill(broker, store, teacher, student, temperature, alpha, top_k, mixup, local_workers, detach,
            timeout_s, as_json, track, track_dir, **options):
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
    from tensorturn import runs
    from tensorturn.merge.distill import distill_spec, parse_student
    from tensorturn.state.manifest import finished_ensemble
    from tensorturn.store.objects import open_store

    training = {k: options.pop(k) for k in TRAINING}
    given = {k: v for k, v in options.items() if v is not None}
    # the ensemble's recipe, as its manifest signed with the pool key names it: this user's own
    # (as `resume` allows a run's); anything else about the run is refused in one line below
    ensemble = finished_ensemble(open_store(store), teacher, "distillation")
    spec = distill_spec(teacher, store, student=parse_student(student), temperature=temperature,
                        alpha=alpha, top_k=top_k, mixup=mixup, allow=[str(ensemble.get("recipe"))],
                        **training, **given)
    tracked = tracking(track, track_dir, detach)
    print_results(launched(lambda observer: runs.Launcher(broker, spec.store_url, tracked(observer)).distill(
        spec, local_workers, detach, timeout_s)), as_json)


@cli.command()
@click.argument("ensemble", metavar="RUN")
@click.option("--rule", type=click.Choice(["best", "greedy", "uniform"]), default="best", show_default=True,
              help="greedy: members join, best first, while the soup's validation score does not "
                   "drop (Wortsman et al. 2022); uniform: the mean of every member's weights; "
                   "best: whichever of the two scores higher on validation.")
@click.option("--eval-batches", type=int, default=None,
              help="Validation and test figures from at most this many forward passes (0: the "
                   f"whole split) [default: the whole split]{bounded('eval_batches')}.")
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
