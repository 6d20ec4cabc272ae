"""Concurrent conflicting writers against a real server: answers are 2xx/4xx, never 5xx, never stalls."""

from __future__ import annotations

import random
from typing import Any

from bcm.devserver import Server
from tests.faults.conftest import hammer, make_nodes, states

WRITERS = 50
SLOW_S = 15.0  # "not slower than a few seconds", generous: the test machine is shared and loaded


def test_fifty_conflicting_writers_get_no_5xx(server: Server) -> None:
    make_nodes(server, "w[1-5]", state="ready")
    rng = random.Random(7)
    kinds: list[Any] = [
        lambda c, n: c.patch(f"/api/v1/nodes/{n}", json={"comment": f"c{rng.random():.6f}"}),
        lambda c, n: c.post("/api/v1/nodes/actions/drain", json={"nodes": n}),
        lambda c, n: c.post("/api/v1/nodes/actions/resume", json={"nodes": n}),
        lambda c, n: c.post("/api/v1/nodes", json={"name": "same-name"}),
        lambda c, n: c.get("/api/v1/nodes", params={"limit": 50}),
        lambda c, n: c.get(f"/api/v1/nodes/{n}"),
    ]
    requests = []
    for i in range(WRITERS * 6):  # bounded: 300 requests, 50 at a time
        kind, node = kinds[i % len(kinds)], f"w{rng.randint(1, 5)}"
        requests.append(lambda c, kind=kind, node=node: kind(c, node))
    answers = hammer(server, WRITERS, requests)
    assert not answers.server_errors(), answers.server_errors()[:5]
    assert answers.slowest < SLOW_S, answers.slowest
    assert set(answers.statuses) <= {200, 201, 409}, sorted(set(answers.statuses))
    assert answers.statuses.count(201) >= 1  # "same-name" was created exactly once ...
    assert sum(1 for s, _, t in answers.got if s == 201 and "same-name" in t) == 1  # ... by one writer
    assert set(states(server, "w[1-5]").values()) <= {"ready", "drained"}


def test_retire_never_loses_to_a_concurrent_resume(server: Server) -> None:
    make_nodes(server, "race[001-100]", state="drained")
    names = [f"race{i:03d}" for i in range(1, 101)]
    requests = []
    for n in names:  # for each node a retire and a resume, side by side
        requests.append(lambda c, n=n: c.post("/api/v1/nodes/actions/retire", json={"nodes": n}))
        requests.append(lambda c, n=n: c.post("/api/v1/nodes/actions/resume", json={"nodes": n}))
    answers = hammer(server, WRITERS, requests)
    assert not answers.server_errors(), answers.server_errors()[:5]
    retire_answers = dict(zip(names, answers.got[0::2], strict=True))
    resume_answers = dict(zip(names, answers.got[1::2], strict=True))
    final = states(server, "race[001-100]")
    retired = {n for n, (s, _, _) in retire_answers.items() if s == 200}
    assert retired, "no retire went through"
    assert all(final[n] == "retired" for n in retired), {
        n: final[n] for n in retired if final[n] != "retired"
    }
    for n in names:
        (retire, _, retire_body), (resume, _, resume_body) = retire_answers[n], resume_answers[n]
        assert retire in (200, 409) and resume in (200, 409), (n, retire, resume)
        assert retire == 200 or resume == 200, (n, retire_body, resume_body)  # one of the two lands
        if retire == 409:  # lost to the resume: the 409 names the state the node moved to
            assert "ready" in retire_body and final[n] == "ready", (n, retire_body, final[n])
        if resume == 409:  # the node was retired first
            assert "retired" in resume_body, resume_body
    # and nothing brings a retired node back
    later = hammer(
        server,
        10,
        [lambda c, n=n: c.post("/api/v1/nodes/actions/resume", json={"nodes": n}) for n in retired],
    )
    assert set(later.statuses) == {409}
    assert {n for n, s in states(server, "race[001-100]").items() if s == "retired"} == retired
