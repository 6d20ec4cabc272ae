"""The dashboard's pure parts: session cookies and CSRF tokens, and SVG charts that escape their text."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from bcm.models.health import HealthSamplePublic
from bcm.ui import charts
from bcm.ui import session as sessions


def test_a_cookie_names_its_token_only_by_id_and_resists_tampering(tmp_path: Path) -> None:
    cookie, ref = sessions.issue(tmp_path, 7, now=1_000_000)
    assert sessions.read(tmp_path, cookie, now=1_000_001) == ref
    assert cookie.startswith("7.") and len(cookie.split(".")) == 4
    token_id, expires, nonce, mac = cookie.split(".")
    assert sessions.read(tmp_path, f"8.{expires}.{nonce}.{mac}", now=1_000_001) is None  # another token
    assert sessions.read(tmp_path, f"{token_id}.{int(expires) + 9999}.{nonce}.{mac}", now=1_000_001) is None
    assert sessions.read(tmp_path, cookie, now=1_000_000 + sessions.LIFETIME_S + 1) is None  # expired
    assert sessions.read(tmp_path / "other-site", cookie, now=1_000_001) is None  # another site's key
    for junk in ("", "x", "1.2.3", "a.b.c.d", "1." * 300):
        assert sessions.read(tmp_path, junk) is None
    sessions.signed_out.add(ref.nonce, ref.expires)
    assert sessions.read(tmp_path, cookie, now=1_000_001) is None  # signed out


def test_csrf_tokens_belong_to_one_session(tmp_path: Path) -> None:
    _c1, a = sessions.issue(tmp_path, 1)
    _c2, b = sessions.issue(tmp_path, 1)
    token = sessions.csrf_token(tmp_path, a.nonce)
    assert sessions.csrf_ok(tmp_path, a.nonce, token)
    assert not sessions.csrf_ok(tmp_path, b.nonce, token)
    assert not sessions.csrf_ok(tmp_path, a.nonce, None) and not sessions.csrf_ok(tmp_path, a.nonce, "")


def test_charts_draw_the_readings_and_escape_every_label() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    samples = [
        HealthSamplePublic(
            time=t0 + timedelta(seconds=10 * i),
            verdict="OK",
            temperature_c=40 + i,
            power_draw_w=300.0,
            utilization_gpu_pct=0,
            memory_used_mib=0,
            ecc_sbe_volatile=i,
            ecc_dbe_volatile=0,
            xid=79 if i == 2 else None,
        )
        for i in range(4)
    ][::-1]  # newest first, as the service gives them
    drawn = charts.gpu_charts(samples)
    assert (
        drawn["temperature"].count("<polyline") == 1
        and len(drawn["temperature"].split('points="')[1].split('"')[0].split()) == 4
    )
    assert drawn["ecc"].count("<polyline") == 2  # single- and double-bit
    assert ">79</text>" in drawn["xid"]
    hostile = charts.line_chart('<script>alert(1)</script>"', "<b>", [("x", [(t0, 1.0)])])
    assert "<script>" not in hostile and "&lt;script&gt;" in hostile and "<b>" not in hostile
    assert "no readings yet" in charts.line_chart("T", "C", [("x", [(t0, None)])])


def test_a_long_history_is_thinned_to_the_charts_width_keeping_its_peaks() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    points = [(t0 + timedelta(seconds=i), 40.0 if i != 517 else 99.0) for i in range(1000)]
    points[600] = (points[600][0], None)
    thinned = charts.thin(points)
    assert len(thinned) == charts.MAX_POINTS
    assert max(v for _, v in thinned if v is not None) == 99.0  # the spike survives
    assert [t for t, _ in thinned] == sorted(t for t, _ in thinned)
    assert charts.thin(points[:10]) == points[:10]
    svg = charts.line_chart("T", "C", [("t", points)])
    assert len(svg.split('points="')[1].split('"')[0].split()) <= charts.MAX_POINTS
