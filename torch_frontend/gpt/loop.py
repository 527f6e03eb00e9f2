"""The training run both trainers share, read top to bottom: train.py (the learned-position GPT)
and chat_train.py (the chat family) each give it a `Recipe`, what differs between them, and
`run` does the rest once:

    the settings checked; the device and the ranks
    --out claimed (its lock; a fresh start refused over another run's files), the resume
        source picked (--resume FILE|auto)
    the model, optimizer and data built; then a fresh start (refused where the tape cannot feed
        a step) or the state loaded (refused where it would replace a newer state of --out; a
        run with nothing left to do returns its summary, rebuilt from its log where it was lost)
    the logs trimmed to where the run starts; then step after step, until the run's last step
        (--steps / --max-steps, or --stop-at), a stop request (SIGINT/SIGTERM) or the end of the
        tape: the step; its log record and evaluation; the recipe's own records; a state on its
        steps. A non-finite loss on any rank, or a non-finite weight, ends the run there on every
        rank (RunDiverged, exit 1): no state is written after it
    the final state, first (a signal's grace period may not outlast an evaluation), then the
        final evaluation; the summary, written by rank 0 before any rank returns

The run directory's rules (the lock, the refusals, writes that fail) are run_directory.py's;
this module decides when each happens, and so which step runs with which batch: trajectory code
(training_state.NOT_TRAJECTORY_CODE does not list it).
"""
from __future__ import annotations

import dataclasses
import gc
import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from packed_adamw.tokenizer.corpus import CorpusNotInstalledError
from packed_adamw.tokenizer.tape import TapeError, TapeExhausted

from .checkpoint import CheckpointError
from .config import ConfigError
from .distributed import Ranks, ddp_rebuild_buckets, launched_rank, resolve_device, start_ranks
from .run_directory import (
    ENDED, GuardedRunLog, RunDirectoryError, RunFiles, RunWriteError, StopRequest, claim, finished_run_summary,
    refuse_earlier_run, refuse_to_replace, write_summary, writing,
)
from .telemetry import RunLog, keep_records_up_to
from .unsharded_twin import is_dtensor

LOG_NAME, SUMMARY_NAME = "log.jsonl", "summary.json"


class RunDiverged(FloatingPointError):
    """The run diverged (a non-finite loss or weight): it ends with exit status 1, its summary
    saying so (`stopped_because: "diverged"`), no state written after the divergence."""


class Diverged(Exception):
    """Inside the loop: what diverged, caught to end the run (RunDiverged says it to the user)."""


# The errors a run ends in with one line (`report`), rather than a traceback.
RUN_ERRORS = (CheckpointError, ConfigError, CorpusNotInstalledError, RunDirectoryError, RunDiverged, RunWriteError,
              TapeError, TapeExhausted)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a recipe's command line asks of the loop: where, from which state, how long, how
    often, and the words its messages use."""

    out: Path
    resume: Path | str | None  # a state (or what the recipe resolves to one), "auto", or None: a fresh start
    steps: int  # the schedule's length (train's --max-steps, chat_train's --steps)
    stop_at: int  # the session ends after this step (0: at `steps`); the schedule stays `steps` long
    save_every: int  # a state every K steps (0: only at the end)
    eval_every: int  # an evaluation every K steps (0: none on the way)
    device: str
    deterministic: bool
    parallel: str
    end_reasons: tuple[str, str]  # summary.json's stopped_because at `steps` and at `stop_at`
    state_noun: str  # "checkpoint" or "state", in messages
    no_states: str | None = None  # why the run writes no states (None: it writes them)
    # a state records why it was written (train.py's checkpoints: "periodic", or why the session
    # ended), so a session stopped right after a periodic state writes it again
    states_record_reason: bool = False
    progress: bool = False  # a progress bar on stderr (rank 0)
    evaluation_in_step_record: bool = False  # an evaluation's fields join its step's log record

    @property
    def last(self) -> int:
        """The step this session ends after, unless it is stopped or its tape runs out first."""
        return min(self.steps, self.stop_at) if self.stop_at else self.steps


class Recipe:
    """What a trainer gives the loop, called in this order (each call on every rank, unless it
    says otherwise). The hooks with a body here are optional; the others each recipe writes.

    Its attributes: `plan` (a Plan), `files` (the RunFiles it writes into --out); after `build`,
    `model` (as the steps run it: DDP's wrapper), `core` (the model itself, whose weights the
    divergence check reads), `batch_shape` (a micro-batch's rows and tokens, for DDP's bucket
    warm-up) and `trajectory` (the configuration its states record, compared on resume)."""

    plan: Plan
    files: RunFiles
    divergence_remedy: str = ""  # what to change after a divergence, before starting again

    # ---- before the run: the settings, and which state it continues ----
    def check(self) -> None:
        """Refuse settings that cannot work, naming the flag (the command line checked them
        already; a run started from code is checked here)."""
        raise NotImplementedError

    def refuse_foreign_states(self) -> None:
        """Refuse --out's files that no run of these settings can continue (rank 0 under the
        lock, then every rank)."""

    def state_to_resume(self, path: Path) -> Path:
        """The state `--resume PATH` names."""
        return path

    def state_info(self, path: Path) -> dict:
        """{"step", "config"} of a state in --out (for refuse_to_replace)."""
        raise NotImplementedError

    # ---- where the run starts ----
    def build(self, device: torch.device, ranks: Ranks) -> None:
        """The model, its optimizer, the data and everything a step needs, as at step 0."""
        raise NotImplementedError

    def tape_feeds_a_step(self) -> bool:
        """Whether the training tape feeds the next step (the data stay where they are)."""
        raise NotImplementedError

    def unfed_start(self) -> Exception:
        """The refusal of a fresh start whose tape cannot feed its first step."""
        raise NotImplementedError

    def start_fresh(self) -> None:
        """The optimizer state of step 0 (bf16 weights: the exact FP32 masters)."""
        raise NotImplementedError

    def load(self, path: Path) -> int:
        """Continue from state `path`: its step."""
        raise NotImplementedError

    def start_session(self, step: int) -> None:
        """What a session sets up once it knows its first step (before the logs are trimmed)."""

    def describe(self, step: int) -> str:
        """The line a session starts with (rank 0 prints it)."""
        raise NotImplementedError

    # ---- a step ----
    def next_batch(self):
        """The next step's data, taken; TapeExhausted (its message saying why) where the tape
        cannot feed the step."""
        raise NotImplementedError

    def train_step(self, step: int, batch):
        """Step `step` (counted from 0) on `batch`: forward, backward, the optimizer's step.
        Returns what `loss` and `step_record` read."""
        raise NotImplementedError

    def logs(self, step: int) -> bool:
        """Whether step `step` (counted from 1, taken) has a log record."""
        raise NotImplementedError

    def loss(self, result) -> float:
        """The step's training loss (waits for the step; collective under torchrun)."""
        raise NotImplementedError

    def step_record(self, step: int, result, loss: float) -> dict:
        """The log record of a logged step (with its "step")."""
        raise NotImplementedError

    def evaluate(self, step: int) -> dict | None:
        """An evaluation's fields for the log (None on a rank that does not evaluate)."""
        raise NotImplementedError

    def after_step(self, step: int, log: RunLog) -> None:
        """The recipe's own records of the step, after its log record and evaluation."""

    def progress(self) -> dict:
        """The progress bar's figures."""
        return {}

    def save(self, step: int, reason: str) -> Path | None:
        """Write the state of step `step` (`reason`: "periodic", or why the session ends); the
        state the run would resume from, None where it writes none. Collective."""
        raise NotImplementedError

    # ---- the end ----
    def evaluates_at_end(self, reason: str) -> bool:
        """Whether a session that ended for `reason` after taking steps ends with an
        evaluation (where its last step had none)."""
        raise NotImplementedError

    def end_session(self, step: int, log: RunLog) -> None:
        """The recipe's last records of the session (not after a divergence)."""

    def summary(self, step: int, reason: str) -> dict:
        """summary.json of this session."""
        raise NotImplementedError

    def summary_from_log(self, records: list[dict], step: int, reason: str) -> dict:
        """summary.json of a finished run (at `step`, ended for `reason`) rebuilt from its log's
        records, where the summary it wrote was lost."""
        raise NotImplementedError

    def figures(self) -> None:
        """Plots of the run (rank 0, before the summary)."""

    def release(self) -> None:
        """Drop everything `build` made (the model and its wrapper, the optimizer, the data): the
        run has ended. `plan` and `files` stay."""
        for name in [name for name in vars(self) if name not in ("plan", "files")]:
            delattr(self, name)


# ---- the run ---------------------------------------------------------------------------------------
def run(recipe: Recipe) -> dict:
    """Run (or resume) training; returns the summary that is also written to summary.json. Under
    torchrun every rank runs this; rank 0 alone prints and writes the log and the summary."""
    recipe.check()
    plan = recipe.plan
    device = resolve_device(plan.device, deterministic=plan.deterministic, parallel=plan.parallel)
    ranks = start_ranks(plan.parallel, device)

    def refuse_fresh_start_over_another_run() -> None:
        if resume_source(recipe) is None:
            refuse_earlier_run(plan.out, recipe.files)

    try:
        # --out is this run's alone until it ends (rank 0 holds its lock), and never another run's
        with claim(plan.out, ranks, device, refuse_fresh_start_over_another_run, files=recipe.files):
            # every rank finds the same state: rank 0 writes none before the first step
            return _run(recipe, device, ranks, resume_source(recipe))
    finally:
        if ranks.distributed:
            # What holds the process group in C++ (DDP's reducer) goes before the group. Freed after
            # it (with the recipe, once run returns), it ran the group's destructor while this thread
            # held the GIL; that destructor joins gloo's worker threads, and a worker still freeing
            # a finished collective's tensors waits for the GIL: a deadlock (gdb caught both threads,
            # 2 gloo ranks under CPU load; the class of torch issue 56297). Freed here, the group's
            # last reference is its Python object, whose destructor releases the GIL.
            recipe.release()
            gc.collect()  # a wrapper in a reference cycle goes now, not at some later collection
        ranks.close()


def _run(recipe: Recipe, device: torch.device, ranks: Ranks, resume: Path | None) -> dict:
    say = print if ranks.main else (lambda *args, **kwargs: None)
    plan, out = recipe.plan, recipe.plan.out
    log_path, summary_path, last = out / LOG_NAME, out / SUMMARY_NAME, plan.last
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the summary's peak memory covers this session
    recipe.build(device, ranks)

    # Where the run starts: step 0, or the state it continues.
    step = 0
    if resume is None:
        if not recipe.tape_feeds_a_step():
            raise recipe.unfed_start()
        recipe.start_fresh()
    else:
        step = recipe.load(resume)
        if 0 < plan.stop_at < step:  # the session would take no step and call the run finished
            flag = "--" + plan.end_reasons[1].replace("_", "-")  # the stop's flag (its summary reason)
            raise RunDirectoryError(f"{flag} {plan.stop_at}: {resume} is already at step {step}; stop at a later "
                                    f"step, or leave {flag} out to continue to the end")
        # Before anything in --out is written or its logs trimmed: the states there are this run's
        # (none newer than the resumed one, none of another configuration), and a resume of a
        # file from elsewhere goes into a directory without another run's files; or it is refused.
        refuse_to_replace(out, recipe.files, resume, step, recipe.trajectory, read_info=recipe.state_info)
        say(f"resumed from {resume} at step {step}")
        if step >= last or not recipe.tape_feeds_a_step():  # nothing to do: nothing in --out changes
            summary = finished_run_summary(
                resume, summary_path, log_path, step,
                lambda records: recipe.summary_from_log(records, step, end_reason(step, plan)),
                write=ranks.main, say=say)
            ranks.barrier()  # a summary rank 0 rebuilt is in place before any rank returns, as below
            return summary
    recipe.start_session(step)
    if ranks.main:
        for name in recipe.files.logs:  # lines after the resume point came from a session that died
            with writing(out / name):
                keep_records_up_to(out / name, step)
    if ranks.parallel == "ddp":
        ddp_rebuild_buckets(recipe.model, *recipe.batch_shape, device)  # every session reduces in the same buckets
    say(recipe.describe(step))

    first_step, saved, evaluated_step = step, None, None  # saved: (step, reason) of the state written last
    last_state = resume  # the newest state of the run: the last good one if it diverges

    def state_of(reason: str) -> tuple[int, str | None]:
        return step, reason if plan.states_record_reason else None

    def save(reason: str) -> None:
        nonlocal saved, last_state
        # No state holds NaN or Inf: the one written last stays the run's last good state.
        bad = nonfinite_weights(recipe.core, ranks, device)
        if bad is not None:
            raise Diverged(f"NaN or Inf in the weights after step {step}"
                           + (f" ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})" if bad else ""))
        written = recipe.save(step, reason)
        saved = state_of(reason)
        if written is not None:
            last_state = written

    def write_records(record: dict | None, evaluation: dict | None) -> None:
        if evaluation is not None and plan.evaluation_in_step_record:
            record, evaluation = {**(record or {"step": step}), **evaluation}, None
        for line in (record, None if evaluation is None else {"step": step, **evaluation}):
            if line is not None:
                log.write(line)

    reason, diverged = None, None
    with StopRequest() as stop, GuardedRunLog(log_path, ranks) as log:
        try:
            with tqdm(total=plan.steps, initial=step, disable=not (plan.progress and ranks.main), unit="step") as bar:
                while True:
                    if step >= last:
                        reason = end_reason(step, plan)
                        break
                    reason = stop.agreed(ranks, device)  # SIGINT or SIGTERM on any rank: stop at this boundary
                    if reason:
                        say(f"\n{reason} received: {'' if plan.no_states else f'writing a {plan.state_noun} and '}"
                            f"stopping at step {step}", file=sys.stderr)
                        break
                    try:
                        batch = recipe.next_batch()  # every rank alike
                    except TapeExhausted as exhausted:
                        reason = "tape_exhausted"
                        say(f"\ntraining tape exhausted at step {step}: {exhausted}")
                        break

                    result = recipe.train_step(step, batch)
                    step += 1
                    logged = recipe.logs(step)
                    saving = (plan.save_every and step % plan.save_every == 0) or step == last
                    loss = recipe.loss(result) if logged or saving else None  # a state follows a finite loss
                    record = recipe.step_record(step, result, loss) if logged else None
                    # every rank's verdict (train.py's loss is each rank's own): all end here or none
                    if loss is not None and ranks.agree(int(not math.isfinite(loss)), device):
                        write_records(record, None)
                        raise Diverged(f"loss {loss} at step {step}" if not math.isfinite(loss)
                                       else f"a non-finite loss on another rank at step {step}")
                    evaluation = None
                    if plan.eval_every and step % plan.eval_every == 0:
                        evaluation, evaluated_step = recipe.evaluate(step), step
                    write_records(record, evaluation)
                    recipe.after_step(step, log)
                    if saving:
                        save("periodic" if step < last else end_reason(step, plan))
                    bar.update(1)
                    bar.set_postfix(recipe.progress())

            if saved != state_of(reason):
                save(reason)  # first: a signal's grace period may not outlast an evaluation
            if step > first_step and evaluated_step != step and recipe.evaluates_at_end(reason):
                write_records(None, recipe.evaluate(step))
            recipe.end_session(step, log)
        except Diverged as error:
            reason, diverged = "diverged", error

    with StopRequest():  # a further SIGINT/SIGTERM now is taken, not raised: the summary gets written
        summary = recipe.summary(step, reason)
        if ranks.main:
            recipe.figures()
            write_summary(summary_path, summary)
        ranks.barrier()  # the summary is in place before any rank returns
    if diverged is not None:
        noun = plan.state_noun
        what = (f"{diverged}; {last_state} stays its last {noun} (none is written after a divergence)"
                if last_state is not None else f"{diverged} ({plan.no_states})" if plan.no_states
                else f"{diverged}, before its first {noun}")
        raise RunDiverged(f"the run diverged: {what}; {recipe.divergence_remedy}, and start again into another --out")
    return summary


# ---- its pieces ------------------------------------------------------------------------------------
def resume_source(recipe: Recipe) -> Path | None:
    """The state the run continues from: --resume's (`recipe.state_to_resume`), or with `auto`
    --out's newest; None for a fresh start (without --resume, or `auto` finding no state), which
    refuse_earlier_run refuses where --out holds another run's files. `auto` over a run that
    diverged is refused: its newest state would diverge again."""
    plan, files = recipe.plan, recipe.files
    recipe.refuse_foreign_states()
    if not plan.resume:
        return None
    if plan.resume == "auto":
        states = files.states(plan.out)
        ended = files.ended(plan.out)
        if ended and states and ended.startswith(ENDED["diverged"]):
            raise RunDirectoryError(f"--resume auto: --out {plan.out} holds a run that has ended ({ended}); start "
                                    "again into another --out (with other settings)")
        return states[-1] if states else None
    return recipe.state_to_resume(Path(plan.resume))


def end_reason(step: int, plan: Plan) -> str:
    """summary.json's stopped_because of a run that takes no more steps at `step`: the end of its
    schedule, --stop-at, or the end of its tape."""
    if step >= plan.steps:
        return plan.end_reasons[0]
    if 0 < plan.stop_at <= step:
        return plan.end_reasons[1]
    return "tape_exhausted"


def nonfinite_weights(model: torch.nn.Module, ranks: Ranks, device: torch.device) -> list[str] | None:
    """The parameters holding NaN or Inf (this rank's shards under FSDP2), or None when every
    rank's are finite (collective: every rank learns whether any rank found one)."""
    bad = [name for name, p in model.named_parameters()
           if not torch.isfinite(p.detach().to_local() if is_dtensor(p) else p.detach()).all()]
    return bad if ranks.agree(int(bool(bad)), device) else None


def report(error: Exception, parallel: str) -> int:
    """The one line on stderr that a run's error ends it with (naming the rank under torchrun),
    and the exit status: 1 for a run that failed (a file it could not write, a divergence), 2 for
    one refused."""
    where = f" (rank {launched_rank()})" if parallel != "none" else ""
    # One write of the whole line: the ranks share torchrun's stderr, and print's separate write of
    # the newline (unbuffered, as under PYTHONUNBUFFERED) let another rank's line in between.
    sys.stderr.write(f"error{where}: {error}\n")
    sys.stderr.flush()
    return 1 if isinstance(error, (RunWriteError, RunDiverged)) else 2
