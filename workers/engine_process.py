"""The engine loop, in a process of its own under the worker actor.

In the actor's own process the engine's Python (the scheduler, the model's op dispatch:
on a small model most of a step) shares one GIL with Ray's event loop, its serialisation
thread pool and the stream's hand-offs, and a step took 1.9x as long as the same engine
stepped alone (`make bench-router`). Here it has a GIL of its own; the actor keeps
everything Ray sees (its calls, the routers' outlets, the commit ledger) and relays:

    actor (asyncio loop)  --commands pipe-->  this process: load, then step, step, ...
    actor (relay thread)  <--results pipe--   ("batch", StepBatch, KV events) per step,
                                              ("snapshot", token, hashes) after a drain

The child dies with the actor (PR_SET_PDEATHSIG), and exits when the actor's end of the
commands pipe closes. Its config comes first on the commands pipe; what it loaded goes
back first, as a WorkerInfo, or why it could not load, as ("failed", why).

`start_engine_process` starts it as a plain interpreter that imports this module, not
through multiprocessing's spawn: spawn's child imports the parent's `__main__`, in a Ray
actor Ray's worker script, so every engine process imported Ray (~700 modules, 0.34 s of
CPU here) and never used it.
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import pickle
import select
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from workers.config import WorkerConfig
from workers.cpus import set_process_cpus
from workers.engine.engine import LLMEngine
from workers.engine.errors import InvalidRequestError
from workers.engine.plan import TokenEvent
from workers.engine.request import FinishReason
from workers.messages import AddRequest, StepBatch, WorkerInfo
from workers.model.tokenizer import TokenizerSpec


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Stall:
    seconds: float


@dataclass(frozen=True)
class Snapshot:
    token: int  # the actor's key for the call waiting on the answer


class Stop:
    pass


Command = AddRequest | Abort | Stall | Snapshot | Stop


_ENTRY = "import sys; from workers.engine_process import main; main(sys.argv[1:])"


def start_engine_process(config: WorkerConfig) -> tuple[subprocess.Popen[bytes], Connection, Connection]:
    """Start the engine process for config: the process, the end the actor sends commands
    on, and the end it reads results from. The child finds this package where the caller
    does (its sys.path, as spawn would give it), and inherits only the two pipes."""
    commands_end, commands = multiprocessing.Pipe(duplex=False)
    results, results_end = multiprocessing.Pipe(duplex=False)
    ends = (commands_end.fileno(), results_end.fileno())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
    process = subprocess.Popen([sys.executable, "-c", _ENTRY, *map(str, ends)], pass_fds=ends, env=env,
                               stdin=subprocess.DEVNULL)
    commands_end.close()
    results_end.close()
    commands.send(config)
    return process, commands, results


def main(argv: list[str]) -> None:
    """The engine process's entry (start_engine_process): argv holds the two pipes' fds."""
    commands = Connection(int(argv[0]), writable=False)
    results = Connection(int(argv[1]), readable=False)
    config: WorkerConfig = commands.recv()
    run_engine(config, commands, results)


def run_engine(config: WorkerConfig, commands: Connection, results: Connection) -> None:
    """The engine process: load the model, say what was loaded, then step until told to
    stop or until the actor is gone."""
    _die_with_parent()
    try:
        if config.engine_cpus:
            try:
                set_process_cpus(config.engine_cpus)  # before torch starts any thread
            except OSError as exc:
                raise ValueError(f"--engine-cpus: worker {config.worker_id} cannot run on CPUs "
                                 f"{list(config.engine_cpus)}: {exc.strerror}") from None
        from workers.model.build import create_engine, kv_pool_size, load

        loaded = load(config.engine)
        engine = create_engine(config.engine, loaded)
        pool = kv_pool_size(config.engine, loaded)
    except Exception as exc:  # noqa: BLE001 - told to the actor, whose info() raises it
        if isinstance(exc, ValueError):  # ModelLoadError is one
            why = str(exc)  # the user's to fix (a file, a flag), and it names which: no traceback
        else:
            why = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()  # into the worker's log: where it went wrong
        results.send(("failed", why))
        return
    param = next(loaded.model.parameters())
    results.send(WorkerInfo(
        worker_id=config.worker_id,
        node_id="",  # the actor's, which knows its Ray node
        model=loaded.name,
        device=str(param.device),
        dtype=str(param.dtype).removeprefix("torch."),
        vocab_size=loaded.config.vocab_size,
        max_model_len=engine.config.max_model_len,
        block_size=engine.config.block_size,
        block_bytes=pool.block_bytes,
        num_blocks=pool.num_blocks,
        tokenizer=TokenizerSpec.of(loaded.tokenizer),
        max_num_seqs=engine.config.max_num_seqs,
        prefix_caching=engine.config.enable_prefix_caching,
    ))
    # The model and everything loading made live as long as this process: out of the
    # collector's sight, a collection walks only what stepping allocates.
    gc.collect()
    gc.freeze()
    try:
        _step_loop(engine, config.report_interval_s, commands, results)
    except (EOFError, BrokenPipeError, OSError):
        return  # the actor is gone


def _step_loop(engine: LLMEngine, interval: float, commands: Connection, results: Connection) -> None:
    # The work between two steps is on every token's path, and it runs with the caches the
    # step's weight reads just emptied: Connection.poll(0) builds a selector per call (~21 us
    # after a step here, 5 us with one poll object kept), and Connection.send pickles through
    # multiprocessing's ForkingPickler (~44 us for a one-event batch, 30 us with
    # pickle.dumps). The actor reads with recv(), which is pickle.loads.
    ready = select.poll()
    ready.register(commands.fileno(), select.POLLIN)

    def waiting(timeout_s: float) -> bool:
        return bool(ready.poll(timeout_s * 1000))  # POLLHUP too: recv() then raises EOFError

    def send(message: tuple[object, ...]) -> None:
        results.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    last_check = 0.0
    last_free = -1
    last_stats = None
    while True:
        events: list[TokenEvent] = []
        added: list[str] = []
        snapshots: list[int] = []
        if waiting(0 if engine.has_unfinished else interval):
            while True:
                command: Command = commands.recv()
                if isinstance(command, Stop):
                    return
                if isinstance(command, Stall):
                    time.sleep(command.seconds)
                elif isinstance(command, Snapshot):
                    snapshots.append(command.token)  # answered after this step's KV events are drained
                elif isinstance(command, Abort):
                    event = engine.abort(command.request_id)
                    if event is not None:
                        events.append(event)
                else:
                    _add(engine, command, events, added)
                if not waiting(0):
                    break
        step_s = 0.0
        if engine.has_unfinished:
            began = time.perf_counter()
            events.extend(engine.step())
            step_s = time.perf_counter() - began
        free = engine.allocator.num_free_blocks
        kv_events = engine.drain_kv_events()
        stats = None
        changed = bool(events or added or kv_events) or free != last_free
        now = time.monotonic()
        if not changed and now - last_check >= interval:
            # Steps that neither emit nor move the free count (a prefill chunk): the rest of
            # the report (its step count is the router's sign of progress) every interval.
            # An idle engine whose report has not changed sends nothing: the actor's
            # heartbeat says it is alive, and no router re-reads the same numbers.
            stats = engine.stats()
            changed = stats != last_stats
            last_check = now
        if changed:
            stats = stats or engine.stats()
            send(("batch", StepBatch(stats, tuple(events), tuple(added), sent_at=time.time(), step_s=step_s),
                  kv_events))
            last_free, last_stats = free, stats
        for token in snapshots:
            # Sent after the batch above: nothing is undrained, the snapshot holds every event sent.
            send(("snapshot", token, engine.cached_block_hashes()))


def _add(engine: LLMEngine, command: AddRequest, events: list[TokenEvent], added: list[str]) -> None:
    try:
        engine.add_request(
            command.request_id, command.prompt_ids, command.params, resume=command.resume,
            cache_salt=command.cache_salt, reserve_tokens=command.reserve_tokens,
        )
    except InvalidRequestError as exc:
        # The router validates first; this is the last line of defence, reported per request.
        events.append(TokenEvent(command.request_id, (), "", 0, finish_reason=FinishReason.ERROR, error=str(exc)))
        return
    added.append(command.request_id)


def _die_with_parent() -> None:
    """SIGKILL this process when the actor's process dies (Linux); elsewhere the closed
    commands pipe ends it at the next poll."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except OSError:
        pass
