"""A room records when it ended, so a host that polls once per loop still measures latency exactly."""

from kvbridge.core.sessions.room import Poll, Room


def test_ended_is_stamped_when_the_room_succeeds_and_never_moves_after():
    room = Room(7)
    room.advance(Poll.TRANSFERRING)
    assert room.ended is None
    room.advance(Poll.SUCCESS)
    first = room.ended
    assert first is not None and first >= room.created
    room.advance(Poll.FAILED, "too late")
    assert room.ended == first and room.poll() == Poll.SUCCESS


def test_ended_is_stamped_when_the_room_fails():
    room = Room(8)
    room.advance(Poll.FAILED, "peer gone")
    assert room.ended is not None and room.failure() == "peer gone"


def _rooms(n):
    from kvbridge.core.sessions.room import Changes

    changes = Changes()
    rooms = [Room(i) for i in range(n)]
    for r in rooms:
        r.changed = changes
    return changes, rooms


def test_hosts_waiting_on_rooms_all_wake_on_each_change_and_none_is_missed():
    # Many hosts wait for their own room while others change: each returns once its room reached the
    # state, however the change fell against its check before sleeping (changes race the waits here).
    import threading

    changes, rooms = _rooms(8)
    got: dict[int, Poll] = {}

    def host(r):
        for state in (Poll.WAITING_FOR_INPUT, Poll.TRANSFERRING, Poll.SUCCESS):
            if r.wait(state, 300.0) != state:  # a missed wake-up would sleep past the join below
                got[r.room] = r.poll()
                return
        got[r.room] = r.poll()

    threads = [threading.Thread(target=host, args=(r,)) for r in rooms]
    for t in threads:
        t.start()
    for state in (Poll.WAITING_FOR_INPUT, Poll.TRANSFERRING, Poll.SUCCESS):
        for r in rooms:
            r.advance(state)
    for t in threads:
        t.join(30.0)
    assert not any(t.is_alive() for t in threads), "a host slept through its room's change"
    assert got == {r.room: Poll.SUCCESS for r in rooms}
    assert changes._waiters == []  # every waiter was woken and taken off


def test_a_wait_that_times_out_returns_the_state_then_and_leaves_no_waiter():
    import time

    changes, (room,) = _rooms(1)
    t0 = time.monotonic()
    assert room.wait(Poll.SUCCESS, 0.05) == Poll.BOOTSTRAPPING
    assert time.monotonic() - t0 >= 0.05 and changes._waiters == []
    assert room.wait(Poll.SUCCESS, 0.0) == Poll.BOOTSTRAPPING and changes._waiters == []
    changes.wake()  # nobody waits: nothing to release
    room.advance(Poll.SUCCESS)
    assert room.wait(Poll.SUCCESS, 0.0) == Poll.SUCCESS


def test_a_change_made_between_a_hosts_check_and_its_sleep_wakes_it():
    # The host's check and its joining the waiters are one step under the lock, which wake() takes: a change whose
    # wake() comes while the host is between the two (held there by a slow append) still wakes it. A host joining
    # outside the lock would sleep through it (the list wake() emptied was the one it had not joined yet).
    import threading
    import time

    changes, (room,) = _rooms(1)
    changer: list[threading.Thread] = []

    class Slow(list):
        def append(self, waiter):  # the host between its check and its sleep
            time.sleep(0.05)
            super().append(waiter)

    def reached() -> bool:
        done = room.poll() == Poll.SUCCESS
        if not changer:  # the first check: the change comes right after it, its wake() while the host appends
            changer.append(threading.Thread(target=room.advance, args=(Poll.SUCCESS,)))
            changer[0].start()
        return done

    changes._waiters = Slow()
    host = threading.Thread(target=changes.wait_for, args=(reached, None), daemon=True)
    host.start()
    host.join(10.0)
    changer[0].join(10.0)
    asleep = host.is_alive()
    changes.wake()  # a host that slept through the change: let it go
    assert not asleep, "the host slept through a change made after its check"
    assert room.poll() == Poll.SUCCESS and not changes._waiters
