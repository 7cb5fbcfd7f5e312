"""The engine thread's events reach the event loop in order, a batch of them on one wake-up."""

import asyncio
import threading

from engine.server.worker import Outbox


def test_events_posted_from_another_thread_arrive_in_order_with_few_wakeups():
    async def main():
        loop = asyncio.get_running_loop()
        outbox, queues = Outbox(loop), [asyncio.Queue() for _ in range(4)]
        wakeups = 0
        schedule = loop.call_soon_threadsafe

        def counting(*args):
            nonlocal wakeups
            wakeups += 1
            return schedule(*args)

        loop.call_soon_threadsafe = counting
        posted = threading.Event()

        def engine():  # one "step": a token for every row, then every row's end
            for step in range(2):
                for i, q in enumerate(queues):
                    assert outbox.post(q, (step, i))
            posted.set()

        t = threading.Thread(target=engine)
        t.start()
        posted.wait()  # the loop is busy while the engine posts: everything waits for one delivery
        t.join()
        got = [[await q.get() for _ in range(2)] for q in queues]
        assert got == [[(0, i), (1, i)] for i in range(4)]
        return wakeups

    assert asyncio.run(main()) == 1


def test_a_closed_loop_refuses_events():
    loop = asyncio.new_event_loop()
    outbox = Outbox(loop)
    loop.close()
    assert not outbox.post(asyncio.Queue(), "x")
    assert outbox.closed and not outbox.post(asyncio.Queue(), "y")
