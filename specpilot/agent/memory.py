"""The loop's memory: runs, rounds, candidates and validated mechanisms in a SQL database (SQLAlchemy).

Any SQLAlchemy URL (default: an SQLite file in the cache directory); every candidate is committed as it
arrives and a round at its end, so an interrupted run resumes after its last finished round. Validated
mechanisms and clear losses are keyed by the deployment's features and retrieved nearest first. Design
notes: docs/design/agent.md.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
from pathlib import Path

from sqlalchemy import JSON, Boolean, Float, Integer, String, create_engine, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from specpilot.agent.space import rewrite_key


class Base(DeclarativeBase):
    pass


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class Run(Base):
    __tablename__ = "runs"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    features: Mapped[dict] = mapped_column(JSON)
    versions: Mapped[dict] = mapped_column(JSON)
    created: Mapped[str] = mapped_column(String(40), default=_now)


class Round(Base):
    __tablename__ = "rounds"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_key: Mapped[str] = mapped_column(String(64), index=True)
    index: Mapped[int] = mapped_column(Integer)
    incumbent: Mapped[dict] = mapped_column(JSON)  # the plan fields after the round
    incumbent_s_per_token: Mapped[float | None] = mapped_column(Float, nullable=True)
    best_s_per_token: Mapped[float | None] = mapped_column(Float, nullable=True)
    done: Mapped[bool] = mapped_column(Boolean, default=False)
    created: Mapped[str] = mapped_column(String(40), default=_now)


class Candidate(Base):
    __tablename__ = "candidates"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_key: Mapped[str] = mapped_column(String(64), index=True)
    round: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(120))
    proposer: Mapped[str] = mapped_column(String(40))
    rewrite_key: Mapped[str] = mapped_column(String(2000))
    rewrite: Mapped[dict] = mapped_column(JSON)
    fields: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    status: Mapped[str] = mapped_column(String(20))  # accepted | rejected | failed | dropped | pruned | incumbent
    reason: Mapped[str] = mapped_column(String(4000), default="")
    s_per_token: Mapped[float | None] = mapped_column(Float, nullable=True)
    gain: Mapped[float | None] = mapped_column(Float, nullable=True)  # incumbent time / candidate time
    verdict: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    folder: Mapped[str | None] = mapped_column(String(1000), nullable=True)
    versions: Mapped[dict] = mapped_column(JSON, default=dict)
    created: Mapped[str] = mapped_column(String(40), default=_now)


class Mechanism(Base):
    __tablename__ = "mechanisms"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    features: Mapped[dict] = mapped_column(JSON)
    target_shape: Mapped[str] = mapped_column(String(200), index=True)
    drafter: Mapped[str] = mapped_column(String(120))
    gpu: Mapped[str] = mapped_column(String(80))
    batch: Mapped[int] = mapped_column(Integer)
    rewrite: Mapped[dict] = mapped_column(JSON)
    plan: Mapped[dict] = mapped_column(JSON)  # the plan fields it produced
    gain: Mapped[float] = mapped_column(Float)
    runs: Mapped[list] = mapped_column(JSON)  # run keys and candidate folders behind it
    versions: Mapped[dict] = mapped_column(JSON)
    created: Mapped[str] = mapped_column(String(40), default=_now)


def default_url(cache_dir: str) -> str:
    folder = Path(cache_dir).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'agent_memory.db'}"


def run_key(features: dict, initial_plan: dict, name: str = "") -> str:
    blob = json.dumps({"features": features, "plan": initial_plan, "name": name}, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def distance(a: dict, b: dict) -> float:
    """How far two deployments' features are: log2 ratios of the target's sizes and the batch, plus a step
    for a different gpu, drafter source, target dtype or workload (a mechanism that paid for one stream
    through the harness need not through the engine: on the CPU pair block 8 on the rows kernel did not)."""
    ta, tb = a.get("target", {}), b.get("target", {})
    d = 0.0
    for k in ("hidden_size", "num_layers", "intermediate_size", "vocab_size"):
        x, y = ta.get(k) or 1, tb.get(k) or 1
        d += abs(math.log2(x / y))
    d += abs(math.log2(max(1, a.get("batch", 1)) / max(1, b.get("batch", 1))))
    d += 2.0 * (a.get("gpu") != b.get("gpu"))
    d += 1.0 * (a.get("drafter", {}).get("source") != b.get("drafter", {}).get("source"))
    d += 0.5 * (ta.get("dtype") != tb.get("dtype"))
    d += 1.0 * (a.get("workload", "harness") != b.get("workload", "harness"))
    return d


class Memory:
    def __init__(self, url: str):
        self.url = url
        kwargs = {"connect_args": {"timeout": 30}} if url.startswith("sqlite") else {}
        self.engine = create_engine(url, **kwargs)
        Base.metadata.create_all(self.engine)

    def start_run(self, key: str, features: dict, versions: dict) -> bool:
        """Register a run; True if it already existed (a resume)."""
        with Session(self.engine) as s, s.begin():
            if s.get(Run, key) is not None:
                return True
            s.add(Run(key=key, features=features, versions=versions))
            return False

    def run_keys(self) -> list[str]:
        with Session(self.engine) as s:
            return list(s.scalars(select(Run.key).order_by(Run.created)))

    def last_round(self, key: str) -> Round | None:
        with Session(self.engine, expire_on_commit=False) as s:
            return s.scalars(select(Round).where(Round.run_key == key, Round.done.is_(True))
                             .order_by(Round.index.desc())).first()

    def rounds(self, key: str) -> list[Round]:
        with Session(self.engine, expire_on_commit=False) as s:
            return list(s.scalars(select(Round).where(Round.run_key == key, Round.done.is_(True))
                                  .order_by(Round.index)))

    def finish_round(self, key: str, index: int, incumbent: dict, incumbent_s: float | None,
                     best_s: float | None) -> None:
        with Session(self.engine) as s, s.begin():
            s.add(Round(run_key=key, index=index, incumbent=incumbent, incumbent_s_per_token=incumbent_s,
                        best_s_per_token=best_s, done=True))

    def record_candidate(self, key: str, round_index: int, **fields) -> None:
        with Session(self.engine) as s, s.begin():
            s.add(Candidate(run_key=key, round=round_index, **fields))

    def candidates(self, key: str, round_index: int | None = None) -> list[Candidate]:
        with Session(self.engine, expire_on_commit=False) as s:
            q = select(Candidate).where(Candidate.run_key == key)
            if round_index is not None:
                q = q.where(Candidate.round == round_index)
            return list(s.scalars(q.order_by(Candidate.id)))

    def tried(self, key: str) -> set[str]:
        """Rewrite keys judged at this run (everything but the incumbent's own measurements)."""
        return {c.rewrite_key for c in self.candidates(key) if c.status != "incumbent"}

    def record_mechanism(self, features: dict, rewrite: dict, plan: dict, gain: float, runs: list,
                         versions: dict) -> None:
        t = features.get("target", {})
        shape = "x".join(str(t.get(k)) for k in ("hidden_size", "num_layers", "intermediate_size", "vocab_size"))
        with Session(self.engine) as s, s.begin():
            s.add(Mechanism(features=features, target_shape=shape, drafter=str(features.get("drafter", {})),
                            gpu=str(features.get("gpu")), batch=int(features.get("batch", 1)), rewrite=rewrite,
                            plan=plan, gain=float(gain), runs=runs, versions=versions))

    def losses(self, features: dict, max_distance: float = 3.0, below: float = 0.5) -> dict[str, str]:
        """{plan key: why} of the plans rejected at deployments within `max_distance` of `features` at a gain
        under `below` (the key: `space.rewrite_key` of the candidate's full plan fields), the nearest run's
        verdict kept."""
        with Session(self.engine, expire_on_commit=False) as s:
            runs = {r.key: r.features for r in s.scalars(select(Run))}
            rows = list(s.scalars(select(Candidate).where(Candidate.status == "rejected")))
        near = {k: d for k, d in ((k, distance(features, f)) for k, f in runs.items()) if d <= max_distance}
        out: dict[str, tuple[float, str]] = {}
        for c in rows:
            if c.run_key in near and c.fields and c.gain is not None and c.gain < below:
                key, d = rewrite_key(c.fields), near[c.run_key]
                if key not in out or d < out[key][0]:
                    shape = runs[c.run_key].get("target", {}).get("name") or "another target"
                    out[key] = (d, f"{c.rewrite_key} ran at {c.gain:.2f}x of its incumbent at {shape} "
                                     f"(run {c.run_key}, round {c.round})")
        return {k: why for k, (_, why) in out.items()}

    def retrieve(self, features: dict, limit: int = 20) -> list[Mechanism]:
        """Validated mechanisms, nearest deployment first (larger gain first among equals)."""
        with Session(self.engine, expire_on_commit=False) as s:
            rows = list(s.scalars(select(Mechanism)))
        rows.sort(key=lambda m: (distance(features, m.features), -m.gain))
        return rows[:limit]
