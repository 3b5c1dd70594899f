"""Unit tests of the worker's bridge (one engine thread, FIFO admission, cancellation) with a fake engine.

The fake engine only stands in for Engine.generate's contract (poll should_cancel between steps, one event per
step, FinishEvent last) so that ordering and cancellation can be checked without model timing. End-to-end
behaviour with the real engine is in test_server_cancel.py.
"""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import trio

from appliance.engine.generate import FinishEvent, GenerationRequest, Timings, TokenEvent
from appliance.server.worker import EngineFailure, NotReady, QueueFull, Worker


class FakeEngine:
    """Prefill `prompt` in chunks of 1 (one poll each), then `max_tokens` decode steps; each unit sleeps `step_s`."""

    def __init__(self, step_s: float = 0.005):
        self.step_s = step_s
        self.started: list[int] = []
        self.thread_ids: set[int] = set()
        self.units_after_cancel = 0
        self.release = threading.Event()
        self.release.set()

    def generate(self, req, should_cancel):
        self.thread_ids.add(threading.get_ident())
        self.started.append(req.prompt_ids[0])
        if req.prompt_ids[0] < 0:
            raise ValueError("engine refuses this")
        timings = Timings()
        for _ in req.prompt_ids:
            if should_cancel():
                yield FinishEvent("cancelled", "", len(req.prompt_ids), 0, [], timings)
                return
            self.release.wait()
            time.sleep(self.step_s)
            timings.prefill_chunks += 1
        ids = []
        for i in range(req.max_tokens):
            time.sleep(self.step_s)
            ids.append(i)
            yield TokenEvent(i, f"t{i} ")
            if should_cancel():
                yield FinishEvent("cancelled", "", len(req.prompt_ids), len(ids), ids, timings)
                return
        yield FinishEvent("length", "", len(req.prompt_ids), len(ids), ids, timings)


def make_worker(engine, queue_limit=2):
    return Worker(load=lambda: SimpleNamespace(engine=engine), queue_limit=queue_limit)


def req(tag: int, prompt_len: int = 2, max_tokens: int = 3) -> GenerationRequest:
    return GenerationRequest(prompt_ids=[tag] * prompt_len, max_tokens=max_tokens)


async def run_one(worker, request, log=None):
    async with worker.admit() as ticket:
        await ticket.wait_turn()
        if log is not None:
            log.append(request.prompt_ids[0])
        events = []
        async for ev in ticket.start(request):
            events.append(ev)
            if isinstance(ev, (FinishEvent, EngineFailure)):
                ticket.finished()
                break
        return events


def test_not_ready_until_loaded_and_events_in_order():
    engine = FakeEngine()

    async def main():
        loading = threading.Event()

        def slow_load():
            loading.wait()
            return SimpleNamespace(engine=engine)

        w = Worker(load=slow_load, queue_limit=1)
        await w.start()
        with pytest.raises(NotReady):
            w.admit()
        loading.set()
        await w.ready.wait()
        events = await run_one(w, req(7, max_tokens=4))
        assert [e.text for e in events[:-1]] == ["t0 ", "t1 ", "t2 ", "t3 "]
        assert events[-1].reason == "length"
        w.stop()
        return w

    w = trio.run(main)
    assert engine.thread_ids and threading.get_ident() not in engine.thread_ids  # never on the trio thread
    assert w.stats.requests_finished == 1 and w.stats.completion_tokens == 4


def test_fifo_order_and_queue_full():
    engine = FakeEngine(step_s=0.01)

    async def main():
        w = make_worker(engine, queue_limit=2)
        await w.start()
        await w.ready.wait()
        order: list[int] = []
        async with trio.open_nursery() as n:
            n.start_soon(run_one, w, req(1, max_tokens=10), order)
            await trio.sleep(0.01)
            assert w.busy
            for tag in (2, 3):
                n.start_soon(run_one, w, req(tag), order)
                await trio.sleep(0.01)
            assert w.waiting == 2
            with pytest.raises(QueueFull) as e:
                w.admit()
            assert e.value.retry_after >= 1
        w.stop()
        return order

    order = trio.run(main)
    assert order == [1, 2, 3]
    assert engine.started == [1, 2, 3]


def test_cancel_stops_engine_at_next_step_and_frees_slot():
    engine = FakeEngine(step_s=0.01)

    async def main():
        w = make_worker(engine)
        await w.start()
        await w.ready.wait()
        got = []

        async def consumer():
            async with w.admit() as ticket:
                await ticket.wait_turn()
                async for ev in ticket.start(req(1, max_tokens=1000)):
                    got.append(ev)
                    if len(got) == 3:
                        return  # leaving without the FinishEvent: the client went away

        await consumer()
        second = await run_one(w, req(2, max_tokens=2))  # the next request is served
        w.stop()
        return w, got, second

    w, got, second = trio.run(main)
    first, after = list(w.stats.traces)
    assert first.finish_reason == "cancelled"
    assert first.cancel_requested
    assert first.polls_after_cancel == 1          # stopped at the first poll after the flag
    assert first.tokens_after_cancel <= 1         # at most the step that was running
    assert first.tokens < 1000
    assert after.finish_reason == "length" and second[-1].reason == "length"
    assert w.stats.requests_cancelled == 1


def test_cancel_while_queued_leaves_line_without_running():
    engine = FakeEngine(step_s=0.01)

    async def main():
        w = make_worker(engine, queue_limit=2)
        await w.start()
        await w.ready.wait()
        order: list[int] = []
        async with trio.open_nursery() as n:
            n.start_soon(run_one, w, req(1, max_tokens=20), order)
            await trio.sleep(0.01)
            scope = trio.CancelScope()

            async def waiter():
                with scope:
                    await run_one(w, req(2), order)

            n.start_soon(waiter)
            await trio.sleep(0.01)
            n.start_soon(run_one, w, req(3), order)  # queued behind 2
            await trio.sleep(0.01)
            assert w.waiting == 2
            scope.cancel()  # 2 goes away while waiting
        w.stop()
        return order, w

    order, w = trio.run(main)
    assert 2 not in engine.started
    assert engine.started == [1, 3]
    assert w.waiting == 0 and not w.busy


def test_engine_exception_becomes_event_and_slot_is_freed():
    engine = FakeEngine()

    async def main():
        w = make_worker(engine)
        await w.start()
        await w.ready.wait()
        bad = await run_one(w, req(-1))
        good = await run_one(w, req(5, max_tokens=1))
        w.stop()
        return bad, good

    bad, good = trio.run(main)
    assert isinstance(bad[-1], EngineFailure) and "refuses" in str(bad[-1].error)
    assert good[-1].reason == "length"


def test_load_failure_is_reported():
    async def main():
        def broken():
            raise OSError("no such model")

        w = Worker(load=broken)
        await w.start()
        await w.ready.wait()
        return w

    w = trio.run(main)
    assert w.state == "failed" and "no such model" in str(w.load_error)
    with pytest.raises(NotReady):
        w.admit()
