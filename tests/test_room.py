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
