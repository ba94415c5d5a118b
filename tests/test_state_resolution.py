"""State-type resolution by class hierarchy (docs/architecture.md, rule 4)."""

import pytest

from kvbridge.core.description.records import StateHandlerSpec
from kvbridge.core.description.state import StateResolver, UnknownPoolTypeError


class SWAPool:
    pass


class DSV4Pool(SWAPool):
    pass


class HiSparseDSV4Pool(DSV4Pool):
    pass


class Unrelated:
    pass


def spec(name, *pools):
    return StateHandlerSpec(name=name, factory=f"handlers:{name}", pool_types=pools)


def test_subclass_of_registered_pool_uses_base_handler():
    r = StateResolver.from_specs([spec("swa", SWAPool)])
    assert r.resolve(DSV4Pool()).name == "swa"
    assert r.resolve(HiSparseDSV4Pool()).name == "swa"


def test_most_specific_registered_class_wins():
    r = StateResolver.from_specs([spec("swa", SWAPool), spec("dsv4_hisparse", HiSparseDSV4Pool)])
    assert r.resolve(HiSparseDSV4Pool()).name == "dsv4_hisparse"
    assert r.resolve(DSV4Pool()).name == "swa"


def test_registration_order_does_not_matter():
    r = StateResolver.from_specs([spec("dsv4_hisparse", HiSparseDSV4Pool), spec("swa", SWAPool)])
    assert r.resolve(HiSparseDSV4Pool()).name == "dsv4_hisparse"


def test_pool_types_can_be_named_by_string_without_importing_them():
    r = StateResolver.from_specs([spec("swa", f"{__name__}:SWAPool")])
    assert r.resolve(DSV4Pool()).name == "swa"


def test_unknown_pool_type_names_the_class_and_the_registered_types():
    r = StateResolver.from_specs([spec("swa", SWAPool)])
    with pytest.raises(UnknownPoolTypeError, match=r"pool type .*Unrelated .*registered pool types: .*SWAPool"):
        r.resolve(Unrelated())


def test_one_pool_type_claimed_by_two_handlers_is_an_error():
    with pytest.raises(ValueError, match="registered twice"):
        StateResolver.from_specs([spec("a", SWAPool), spec("b", SWAPool)])
