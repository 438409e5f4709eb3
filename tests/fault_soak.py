"""A fault soak of the trainer, shared by `benchmarks/fault_soak.py` and `tests/e2e/test_fault_soak.py`: one run
on 4 CPU ranks (torchrun `--max-restarts=1`, `--resume=auto`) hit by one fault of each kind (`two-ranks` in half
the seeds), in an order and at steps drawn from a seed, then compared with an uninterrupted run of the same config,
loss by loss and weight by weight.

The steps after the first checkpoint are cut into one slot per fault. A slot is one launch, run to the slot's end
(`--steps`, so that it ends with a checkpoint) and hit by the slot's fault:

- `rank-kill`: one rank SIGKILLed once step s is logged (mid-step); torchrun restarts the group, which resumes;
- `sigterm`: SIGTERM to the job once step s is logged: the ranks save a checkpoint and exit; the next launch resumes;
- `write-kill`: one rank SIGKILLs itself partway through its file of the first checkpoint at or after step s;
  torchrun restarts the group, which removes the `.tmp` left behind and resumes from the checkpoint before;
- `enospc`: the disk fills while one rank writes the first checkpoint at or after step s (`OSError(ENOSPC)`): the
  run stops with a `CheckpointError` naming it, and torchrun's restart resumes from the checkpoint before;
- `corrupt-shard`: a byte of a `.distcp` file of the slot's last checkpoint is flipped; the next launch must skip
  that checkpoint with its reason and fall back to the one before;
- `ray-server-kill`: the slot runs with `--loader ray`; the process of one data server is SIGKILLed once step s is
  logged (Ray restarts the actor);
- `two-ranks`: the slot runs on 2 ranks (its checkpoint resharded from 4), the next one on 4 again.

A run that stops short of the last step (a SIGTERM or a corrupted checkpoint in the last slot) is finished by one
more launch. The writer faults need no hook in the package: torchrun runs this module (`-m tests.fault_soak`) in
place of `bytescale_compile.train`, and with `FAULT_ENV` set it wraps DCP's `_write_item` before it starts the
trainer. Every launch has a time limit: a hang kills the job and fails the fault it was hit by.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from bytescale_compile.train.__main__ import PROG
from tests.trainer_runs import ENV, ROOT, Workspace, run_metrics, torchrun_command, train_args

KINDS = ("rank-kill", "sigterm", "write-kill", "enospc", "corrupt-shard", "ray-server-kill", "two-ranks")
RANKS = 4
FAULT_ENV = "BYTESCALE_SOAK_FAULT"
"""The writer fault of a launch, as JSON of `WriterFault`, read by this module's torchrun workers."""
LAUNCH_TIMEOUT_S = 600.0
"""One launch, its restart included: several times what a slot takes (a start is about a minute on 2 cores)."""
SERVERS = 2
"""`--data-servers` of the Ray slot."""

ROUNDING_DW = 1e-5
"""The bound on max |dw| of the final weights when a segment ran on 2 ranks. Its gradients are the same sums in
another order, so the weights drift from the uninterrupted run's by fp32 rounding: a few ulps of weights of
magnitude up to ~1 (ulp 1.2e-7). A real fault (a step lost or run twice, a shard of another step) moves weights
by about one Adam step, the learning rate: 1e-4 at the end of the schedule, 10x this bound."""

STEP_LINE = re.compile(r"^\[\w+\] step (\d+):")
RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")
SKIPPED = re.compile(r"skipped checkpoint (\S+): .*$", re.M)
ERROR = re.compile(rf"^{re.escape(PROG)}: error.*$", re.M)
ANSI = re.compile(r"\x1b\[[0-9;]*m")

Outcome = Literal["survived", "refused", "failed"]


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    """Where it hits: the step logged before a kill or SIGTERM, the first checkpoint step a writer fault may hit,
    the checkpoint whose file is flipped, or the first step on 2 ranks."""
    target: int
    """The rank killed or whose writer fails, or the data server killed (unused by the other kinds)."""


@dataclass(frozen=True)
class Slot:
    """One launch of the soak: its fault, and the step it runs to."""

    fault: Fault
    end: int

    @property
    def ranks(self) -> int:
        return 2 if self.fault.kind == "two-ranks" else RANKS


@dataclass(frozen=True)
class WriterFault:
    """What a worker injects into DCP's writer: at the first checkpoint of step >= `step`, rank `rank` writes the
    first tensor of its file, then dies (`write-kill`) or finds the disk full (`enospc`); once, as the file
    `marker`, created when it fires, records across restarts."""

    kind: str
    step: int
    rank: int
    marker: str


@dataclass
class FaultReport:
    """What became of one fault."""

    fault: Fault
    outcome: Outcome
    message: str
    """The line that shows it: the resume, the checkpoint skipped and why, the error of a refused save, or what
    went wrong."""
    steps_lost: int
    """Steps run before the fault and again after it: the last step logged before each resume that followed,
    less the step resumed from."""


@dataclass(frozen=True)
class SoakConfig:
    """The run every launch continues, and the uninterrupted run it is compared with."""

    steps: int = 60
    checkpoint_every: int = 5

    def args(self, ws: Workspace, out: Path, end: int) -> list[str]:
        """The trainer's arguments for a launch running to step `end` (the schedule is always the whole run's)."""
        return train_args(
            ws,
            out,
            "--steps",
            str(end),
            "--decay-steps",
            str(self.steps),
            "--checkpoint-every",
            str(self.checkpoint_every),
            "--log-every",
            "1",
            "--resume=auto",
        )


@dataclass
class SoakResult:
    seed: int
    config: SoakConfig
    run: Path
    slots: list[Slot]
    reports: list[FaultReport]
    statuses: list[int | None]
    """Each launch's exit status (None: it ran past `LAUNCH_TIMEOUT_S`)."""
    logged: list[int]
    """The steps of the run's metrics.jsonl, in order."""
    losses: list[float]
    reference_losses: list[float]
    max_abs_dw: float
    """Over every tensor of final/, against the uninterrupted run's (inf: final/ missing or of another model)."""
    wall_s: float
    reference_wall_s: float

    @property
    def two_ranks_from(self) -> int | None:
        """The first step run on 2 ranks (None: none was)."""
        return next((s.fault.step for s in self.slots if s.fault.kind == "two-ranks"), None)

    def max_loss_rel(self) -> float:
        """The largest relative difference of a step's loss from the uninterrupted run's (inf: other steps)."""
        if len(self.losses) != len(self.reference_losses):
            return float("inf")
        return max(abs(a - b) / abs(b) for a, b in zip(self.losses, self.reference_losses))

    def problems(self) -> list[str]:
        """What the soak must not show: a fault neither survived nor refused with its message, losses other than
        the uninterrupted run's (to rtol 1e-5; bit-identical before any step on 2 ranks), final weights not
        bit-identical without a 2-rank segment, or off by more than `ROUNDING_DW` with one."""
        found = [f"{r.fault.kind} at step {r.fault.step}: {r.message}" for r in self.reports if r.outcome == "failed"]
        if len(self.reports) < len(self.slots):
            found.append(f"only {len(self.reports)} of {len(self.slots)} faults were injected")
        hung = [k + 1 for k, status in enumerate(self.statuses) if status is None]
        if hung:
            found.append(f"launches {hung} ran past {LAUNCH_TIMEOUT_S:.0f} s")
        if self.logged != list(range(1, self.config.steps + 1)):
            found.append(f"metrics.jsonl holds steps {self.logged}, not 1 to {self.config.steps}")
        elif self.max_loss_rel() > 1e-5:
            found.append(f"losses differ from the uninterrupted run's by up to {self.max_loss_rel():.2e} (relative)")
        identical = self.config.steps if self.two_ranks_from is None else self.two_ranks_from - 1
        differ = [s + 1 for s, (a, b) in enumerate(zip(self.losses[:identical], self.reference_losses)) if a != b]
        if differ:
            found.append(f"the losses of steps {differ} are not bit-identical, and no step before ran on 2 ranks")
        bound = 0.0 if self.two_ranks_from is None else ROUNDING_DW
        if not self.max_abs_dw <= bound:
            found.append(f"final weights: max |dw| {self.max_abs_dw:.3e} over {bound:.0e}")
        return found

    def table(self) -> str:
        lines = [
            f"seed {self.seed}: {self.config.steps} steps on {RANKS} ranks, a checkpoint every "
            f"{self.config.checkpoint_every}; {len(self.statuses)} launches",
            "",
            "| fault | step | rank / server | outcome | steps lost | message |",
            "|---|---|---|---|---|---|",
        ]
        for r in self.reports:
            target = (
                str(r.fault.target) if r.fault.kind in ("rank-kill", "write-kill", "enospc", "ray-server-kill") else "-"
            )
            message = r.message.replace(f"{self.run}/", "")
            lines.append(f"| {r.fault.kind} | {r.fault.step} | {target} | {r.outcome} | {r.steps_lost} | {message} |")
        segment = "no segment on 2 ranks" if self.two_ranks_from is None else f"2 ranks from step {self.two_ranks_from}"
        lines += [
            "",
            f"losses: {len(self.losses)} steps, max relative difference from the uninterrupted run "
            f"{self.max_loss_rel():.2e}",
            f"final weights: max |dw| {self.max_abs_dw:.3e} ({segment})",
            f"wall time: soak {self.wall_s:.0f} s, uninterrupted run {self.reference_wall_s:.0f} s",
            f"problems: {'; '.join(self.problems()) or 'none'}",
        ]
        return "\n".join(lines)


# -- the plan --------------------------------------------------------------------------------------------------


def draw_slots(seed: int, config: SoakConfig) -> list[Slot]:
    """Every kind once (`two-ranks` in half the seeds, so that the others check bit-identical weights), in an order
    drawn from `seed`, each in a slot of its own between the first checkpoint and the last step. `two-ranks` is
    neither first nor last, so that it resumes a 4-rank checkpoint and the next launch its own."""
    rng = random.Random(seed)
    kinds = [kind for kind in KINDS if kind != "two-ranks" or rng.random() >= 0.5]
    order = rng.sample(kinds, len(kinds))
    if "two-ranks" in order:
        i = order.index("two-ranks")
        j = min(max(i, 1), len(order) - 2)
        order[i], order[j] = order[j], order[i]
    first = config.checkpoint_every
    width = (config.steps - first) / len(order)
    if width < 3:
        raise ValueError(f"{config.steps} steps leave {width:.1f} steps a fault, 3 at least")
    ends = [first + round(width * (k + 1)) for k in range(len(order))]
    slots = []
    for kind, start, end in zip(order, [first, *ends], ends):
        if kind == "corrupt-shard":
            step = end
        elif kind == "two-ranks":
            step = start + 1
        else:  # with a step and the last checkpoint after it, so that a kill or SIGTERM lands in a running step
            step = rng.randint(start + 1, end - 2)
        target = rng.randrange(SERVERS if kind == "ray-server-kill" else RANKS)
        slots.append(Slot(Fault(kind, step, target), end))
    return slots


# -- one launch ------------------------------------------------------------------------------------------------


@dataclass
class Launch:
    """A torchrun job in a process group of its own, its output going to `log`."""

    proc: subprocess.Popen
    log: Path
    began: float = field(default_factory=time.monotonic)
    seen: dict[int, str] = field(default_factory=dict)
    """Every process of the job seen while it ran, and its start time: what is left of them is killed at the end
    (Ray's processes may leave the group)."""
    looked: float = 0.0
    """When `seen` was last brought up to date."""

    def text(self) -> str:
        return ANSI.sub("", self.log.read_text(errors="replace")) if self.log.exists() else ""

    def last_step(self) -> int:
        return max(_steps(self.text()), default=0)

    def _running(self) -> bool:
        if time.monotonic() - self.looked > 1.0:  # a look at every process costs the job's 2 cores too
            self.seen.update({pid: _started(pid) for pid in _descendants(self.proc.pid)})
            self.looked = time.monotonic()
        return self.proc.poll() is None and time.monotonic() - self.began < LAUNCH_TIMEOUT_S

    def wait_for_step(self, step: int) -> bool:
        """Until step `step` (or a later one) is logged: True; False when the job ended or ran out of time first."""
        while self._running():
            if self.last_step() >= step:
                return True
            time.sleep(0.05)
        return False

    def finish(self) -> int | None:
        """Wait for its exit status; None when it ran past `LAUNCH_TIMEOUT_S`. Whatever is left of it is killed."""
        while self._running():
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=1.0)
        status = self.proc.poll()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for pid, started in self.seen.items():
            if _started(pid) == started:  # still that process, not a new one with its number
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return status


def start(command: list[str], log: Path, env: dict[str, str] | None = None) -> Launch:
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**ENV, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Launch(proc, log)


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name ([] when it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _started(pid: int) -> str:
    fields = _stat(pid)
    return fields[19] if len(fields) > 19 else ""


def _descendants(pid: int) -> set[int]:
    parents = {
        int(p.name): fields[1] for p in Path("/proc").iterdir() if p.name.isdigit() and (fields := _stat(int(p.name)))
    }
    found: set[int] = set()
    frontier = {str(pid)}
    while frontier:
        frontier = {str(child) for child, parent in parents.items() if parent in frontier}
        found.update(int(child) for child in frontier)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _rank_of(pid: int) -> str | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((item[5:].decode() for item in environ if item.startswith(b"RANK=")), None)


def _hit(job: Launch, fault: Fault) -> str:
    """SIGTERM the running `job`, or SIGKILL one of its ranks or data servers; what was done, or why not."""
    if fault.kind == "sigterm":
        os.killpg(job.proc.pid, signal.SIGTERM)  # as a scheduler preempts a job: every process of it
        return "SIGTERM sent"
    processes = sorted(_descendants(job.proc.pid))
    if fault.kind == "rank-kill":
        victims = [p for p in processes if "tests.fault_soak" in _cmdline(p) and _rank_of(p) == str(fault.target)]
    else:
        victims = [p for p in processes if _cmdline(p).startswith("ray::DataServer")][fault.target :]
    if not victims:
        return f"no process of {fault.kind} target {fault.target} found"
    os.kill(victims[0], signal.SIGKILL)
    return f"killed pid {victims[0]}"


def _steps(text: str) -> list[int]:
    return [int(m.group(1)) for line in text.splitlines() if (m := STEP_LINE.match(line))]


# -- the soak --------------------------------------------------------------------------------------------------


def _command(
    ws: Workspace, config: SoakConfig, out: Path, end: int, ranks: int = RANKS, ray: bool = False
) -> list[str]:
    args = config.args(ws, out, end)
    if ray:
        args += ["--loader", "ray", "--ray-cpus", "2", "--data-servers", str(SERVERS)]
    command = torchrun_command(ranks, args, "--max-restarts=1")
    command[command.index("bytescale_compile.train")] = "tests.fault_soak"
    return command


def reference_run(ws: Workspace, config: SoakConfig, out: Path) -> float:
    """The uninterrupted run of `config` on 4 ranks into `out`; its wall seconds."""
    began = time.monotonic()
    job = start(_command(ws, config, out, config.steps), out.with_name(out.name + ".log"))
    status = job.finish()
    if status != 0:
        raise RuntimeError(f"the uninterrupted run failed (exit status {status}): {job.text()[-3000:]}")
    return time.monotonic() - began


@dataclass
class _Ran:
    """One launch's output, split where the aftermath of the fault before it ends."""

    fault: int | None
    """The index of its slot's fault (None: the launch that finishes the run)."""
    head: str
    """The aftermath of the fault before: the resume it starts with (all of it for the finishing launch)."""
    tail: str
    status: int | None
    hit: str
    """What the harness did to it, or what the writer fault did."""
    damaged: Path | None = None
    """The checkpoint the harness flipped a byte of after it."""


def _after_start(text: str) -> int:
    """Where a launch's own work begins: after the resume it starts with, if any."""
    for m in re.finditer(r"^.*$", text, re.M):
        if STEP_LINE.match(m.group(0)):
            return 0
        if RESUMED.search(m.group(0)):
            return m.end()
    return 0


def _flip_byte(checkpoint: Path, rng: random.Random) -> Path:
    shard = rng.choice(sorted(checkpoint.glob("*.distcp")))
    data = bytearray(shard.read_bytes())
    data[rng.randrange(len(data))] ^= 0x01
    shard.write_bytes(bytes(data))
    return shard


def run_soak(
    ws: Workspace, config: SoakConfig, out: Path, seed: int, reference: Path, reference_wall_s: float
) -> SoakResult:
    """The soak of `seed` in `out` (the run in `out/run`, launch k's output in `out/launch_<k>.log`), compared
    with `reference`, the directory of the uninterrupted run of `config` (which took `reference_wall_s`)."""
    began = time.monotonic()
    run = out / "run"
    slots = draw_slots(seed, config)
    flip = random.Random(seed)
    ran: list[_Ran] = []

    def launch(end: int, ranks: int = RANKS, ray: bool = False, env: dict[str, str] | None = None) -> Launch:
        return start(_command(ws, config, run, end, ranks, ray), out / f"launch_{len(ran) + 1}.log", env)

    for k, slot in enumerate(slots):
        fault, marker = slot.fault, out / f"fired_{k}"
        env = {}
        if fault.kind in ("write-kill", "enospc"):
            env[FAULT_ENV] = json.dumps(asdict(WriterFault(fault.kind, fault.step, fault.target, str(marker))))
        job = launch(slot.end, slot.ranks, fault.kind == "ray-server-kill", env)
        split: int | None = None
        hit, damaged = "", None
        if fault.kind in ("rank-kill", "sigterm", "ray-server-kill"):
            if job.wait_for_step(fault.step):
                split, hit = len(job.text()), _hit(job, fault)
            else:
                hit = f"step {fault.step} was never logged"
        status = job.finish()
        text = job.text()
        if fault.kind in ("write-kill", "enospc"):
            hit = "fired" if marker.exists() else f"no checkpoint of step {fault.step} or later was written"
        if fault.kind == "corrupt-shard" and status == 0:
            damaged = run / "checkpoints" / f"step_{slot.end:08d}"
            hit = f"flipped a byte of {_flip_byte(damaged, flip).relative_to(run)}"
        if split is None:
            split = 0 if fault.kind == "two-ranks" else _after_start(text)
        ran.append(_Ran(k, text[:split], text[split:], status, hit, damaged))
        if status is None:
            break
    else:
        logged = _steps("".join(r.head + r.tail for r in ran))
        if max(logged, default=0) < config.steps or slots[-1].fault.kind == "corrupt-shard":
            job = launch(config.steps)
            status = job.finish()
            ran.append(_Ran(None, job.text(), "", status, ""))
    records = run_metrics(run) if (run / "metrics.jsonl").exists() else []
    return SoakResult(
        seed,
        config,
        run,
        slots,
        _judge_all(slots, ran),
        [r.status for r in ran],
        [r["step"] for r in records],
        [r["loss"] for r in records],
        [r["loss"] for r in run_metrics(reference)],
        max_abs_difference(run / "final", reference / "final"),
        time.monotonic() - began,
        reference_wall_s,
    )


@dataclass(frozen=True)
class _Resume:
    line: str
    path: str
    lost: int


def _judge_all(slots: list[Slot], ran: list[_Ran]) -> list[FaultReport]:
    """Each fault judged on its aftermath: the output from it to the next fault."""
    texts = ["" for _ in slots]
    resumes: list[list[_Resume]] = [[] for _ in slots]
    owner, last = -1, 0
    for r in ran:
        parts = [(r.head, owner)]
        owner = owner if r.fault is None else r.fault
        for part, fault in [*parts, (r.tail, owner)]:
            if fault >= 0:
                texts[fault] += part
            for line in part.splitlines():
                if m := STEP_LINE.match(line):
                    last = int(m.group(1))
                elif (m := RESUMED.search(line)) and fault >= 0:
                    resumes[fault].append(_Resume(line.strip(), m.group(1), last - int(m.group(2))))
                    last = int(m.group(2))
    own = {r.fault: r for r in ran}
    damaged = {r.damaged for r in ran if r.damaged is not None}
    return [_judge(slot.fault, texts[k], resumes[k], own[k], damaged) for k, slot in enumerate(slots) if k in own]


def _line(text: str, pattern: str) -> str:
    """The first line of `text` matching `pattern`, stripped ('' when none)."""
    m = re.search(rf"^.*{pattern}.*$", text, re.M)
    return m.group(0).strip() if m else ""


def _judge(fault: Fault, text: str, resumes: list[_Resume], own: _Ran, damaged: set[Path]) -> FaultReport:
    """Survived (the run went on), refused (it stopped with a one-line error naming the fault, and the next start
    resumed), or failed (what was missing), from the output of the fault's aftermath; `damaged` holds the checkpoints
    the soak flipped a byte of, which any later resume may skip."""
    lost = sum(r.lost for r in resumes)
    m = ERROR.search(text)
    error = m.group(0) if m else ""

    def failed(why: str) -> FaultReport:
        return FaultReport(fault, "failed", f"{why} ({own.hit or 'nothing done'}, exit status {own.status})", lost)

    if own.status is None:
        return failed(f"a hang: the launch ran past {LAUNCH_TIMEOUT_S:.0f} s")
    skipped = [m for m in SKIPPED.finditer(text) if Path(m.group(1)) not in damaged]
    if skipped:  # a checkpoint committed before the fault no longer verifies
        return failed(f"a checkpoint was lost: {skipped[0].group(0)}")
    if fault.kind == "rank-kill":
        if not own.hit.startswith("killed") or own.status != 0 or not resumes:
            return failed(error or f"{len(resumes)} resumes")
        return FaultReport(fault, "survived", resumes[0].line, lost)
    if fault.kind == "sigterm":  # torchrun itself exits 1 on a SIGTERM, whatever its workers did
        stopped = re.search(r"stopped by SIGTERM after step \d+: checkpoint (\S+) saved", text)
        if stopped is None or not resumes or resumes[0].path != stopped.group(1):
            return failed(error or "no checkpoint saved on SIGTERM, or not the one resumed")
        return FaultReport(fault, "survived", stopped.group(0), lost)
    if fault.kind == "write-kill":
        removed = _line(text, r"removed \S+\.tmp, left by an interrupted checkpoint save")
        if own.hit != "fired" or own.status != 0 or not removed or not resumes:
            return failed(error or removed or "no .tmp removed")
        return FaultReport(fault, "survived", f"{removed}; {resumes[0].line}", lost)
    if fault.kind == "enospc":
        removed = _line(text, r"removed \S+\.tmp, left by an interrupted checkpoint save")
        if own.hit != "fired" or own.status != 0 or "No space left on device" not in error or not resumes:
            return failed(error or "no error")
        if not removed:
            return failed(f"the unfinished .tmp was not removed: {error}")
        return FaultReport(fault, "refused", error, lost)
    if fault.kind == "corrupt-shard":
        flipped = next((m.group(0) for m in SKIPPED.finditer(text) if "checksum differs" in m.group(0)), "")
        if not own.hit.startswith("flipped") or not flipped or not resumes:
            return failed(error or "no checkpoint skipped")
        return FaultReport(fault, "survived", flipped, lost)
    if fault.kind == "ray-server-kill":
        if own.hit.startswith("killed") and own.status == 0 and not error:
            retried = _line(text, r"Task DataServer\.\w+ failed")  # when a read was in flight
            message = f"data server {fault.target}: {own.hit}, the run went on" + (f"; {retried}" if retried else "")
            return FaultReport(fault, "survived", message, lost)
        if own.hit.startswith("killed") and error and resumes:
            return FaultReport(fault, "refused", error, lost)
        return failed(error or "the run did not go on")
    if fault.kind == "two-ranks":
        down = _line(text, r"resharding \S+: saved by 4 rank\(s\).*loaded by 2 rank\(s\)")
        up = _line(text, r"resharding \S+: saved by 2 rank\(s\).*loaded by 4 rank\(s\)")
        if not down or not up or own.status != 0:
            return failed(error or f"{down or 'no resharding from 4 ranks to 2'}; {up or 'none back to 4'}")
        return FaultReport(fault, "survived", f"{down}; then {up.split(': ', 1)[-1]}", lost)
    raise ValueError(f"unknown fault kind {fault.kind!r}")


def max_abs_difference(final: Path, reference: Path) -> float:
    """max |a - b| over every tensor of two `save_pretrained` directories (inf: a file or a tensor missing)."""
    from safetensors.torch import load_file

    if not (final / "model.safetensors").exists():
        return float("inf")
    a, b = load_file(final / "model.safetensors"), load_file(reference / "model.safetensors")
    if a.keys() != b.keys():
        return float("inf")
    return max(float((a[name].double() - b[name].double()).abs().max()) for name in a)


# -- the workers: the trainer, with a writer fault --------------------------------------------------------------


def _inject(fault: WriterFault) -> None:
    """Wrap DCP's `_write_item`: the faulted rank writes the first item of its file of the first checkpoint at or
    after `fault.step`, then dies or finds the disk full."""
    from torch.distributed.checkpoint import filesystem

    write_item = filesystem._write_item
    tmp = re.compile(r"step_(\d+)\.tmp")

    def faulty(*args: Any, **kwargs: Any) -> Any:
        written = write_item(*args, **kwargs)
        stream = args[1]
        m = tmp.search(str(getattr(stream, "name", "")))
        if m is None or int(m.group(1)) < fault.step or os.environ.get("RANK") != str(fault.rank):
            return written
        try:
            os.close(os.open(fault.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:  # it fired before the restart
            return written
        stream.flush()
        if fault.kind == "write-kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), stream.name)

    filesystem._write_item = faulty


def _worker() -> int:
    """A torchrun worker: the trainer, with the launch's writer fault."""
    from bytescale_compile.train.__main__ import main

    if FAULT_ENV in os.environ:
        _inject(WriterFault(**json.loads(os.environ[FAULT_ENV])))
    return main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(_worker())
