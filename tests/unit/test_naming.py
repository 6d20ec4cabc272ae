"""Hostlists, names, MAC and IP sequences."""

from __future__ import annotations

import pytest

from bcm.domain.inheritance import effective_settings
from bcm.domain.naming import (
    check_name,
    expand_hostlist,
    fold_hostlist,
    ip_sequence,
    mac_sequence,
    normalize_ip,
    normalize_mac,
)
from bcm.errors import InvalidInput


def test_hostlist_expands_and_folds() -> None:
    names = expand_hostlist("gpu[01-04],login1")
    assert names == ["gpu01", "gpu02", "gpu03", "gpu04", "login1"]
    assert fold_hostlist(names[:4]) == "gpu[01-04]"


@pytest.mark.parametrize("bad", ["gpu[01-", "gpu[5-2]", "", "  ", "GPU01", "-x", "a_b", "gpu[01-03]x_"])
def test_malformed_hostlists_are_refused(bad: str) -> None:
    with pytest.raises(InvalidInput) as exc:
        expand_hostlist(bad)
    assert exc.value.field == "nodes"


def test_names() -> None:
    assert check_name("gpu-01") == "gpu-01"
    for bad in ["", "x" * 64, "a.b", "-a", "a-", "Ab"]:
        with pytest.raises(InvalidInput):
            check_name(bad)


def test_macs() -> None:
    assert normalize_mac("52-54-00-AA-BB-CC") == "52:54:00:aa:bb:cc"
    assert normalize_mac("525400aabbcc") == "52:54:00:aa:bb:cc"
    for bad in ["52:54:00:aa:bb", "zz:54:00:aa:bb:cc", "01:00:5e:00:00:01", "52:54-00:aa:bb:cc"]:
        with pytest.raises(InvalidInput):
            normalize_mac(bad)
    assert mac_sequence("52:54:00:00:00:fe", 3) == [
        "52:54:00:00:00:fe",
        "52:54:00:00:00:ff",
        "52:54:00:00:01:00",
    ]
    with pytest.raises(InvalidInput):
        mac_sequence("fe:ff:ff:ff:ff:ff", 2)


def test_ips() -> None:
    assert normalize_ip("198.18.0.011".replace("011", "11")) == "198.18.0.11"
    assert ip_sequence("198.18.0.254", 3) == ["198.18.0.254", "198.18.0.255", "198.18.1.0"]
    for bad in ["198.18.0.256", "nope", "224.0.0.1", "0.0.0.0"]:
        with pytest.raises(InvalidInput):
            normalize_ip(bad)
    with pytest.raises(InvalidInput):
        ip_sequence("255.255.255.255", 2)


def test_node_overrides_category_overrides_default() -> None:
    eff = effective_settings(
        {"image": "rocky9", "kernel_args": None}, {"image": "ubuntu", "kernel_args": "quiet"}
    )
    assert eff.values["image"] == "rocky9" and eff.sources["image"] == "node"
    assert eff.values["kernel_args"] == "quiet" and eff.sources["kernel_args"] == "category"
    assert eff.values["wlm_role"] == "compute" and eff.sources["wlm_role"] == "default"
    assert effective_settings({}, None).sources == {k: "default" for k in eff.sources}


@pytest.mark.parametrize(
    "stepped", ["a[0-999999999/999999999]", "a[0-999999999/2]", "a[1,0-999999999/500000000]"]
)
def test_a_stepped_range_spanning_a_billion_is_refused_naming_the_field(stepped: str) -> None:
    # the size (2 names) was fine, but ClusterShell asserted "range too large": a 500 on every hostlist route
    with pytest.raises(InvalidInput) as exc:
        expand_hostlist(stepped, "discover_names")
    assert exc.value.field == "discover_names" and "spans" in str(exc.value)


def test_a_stepped_range_below_the_span_limit_expands() -> None:
    assert expand_hostlist("a[0-999999997/499999998]") == ["a0", "a499999998", "a999999996"]
