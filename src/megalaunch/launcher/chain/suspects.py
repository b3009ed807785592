"""Bad nodes, as the chain acts on them (docs/architecture.md, "The chain"): the node(s) a failed or
unhealthy segment points at become suspects in the team's node-health ledger, and a successor excludes
what is suspect when it is queued, or, queued before the failure, when the segment ends. Who is to blame
and which suspects a job can do without is launcher/accounting/nodes.py's; recording it here is best
effort: the node-health ledger and Slurm's answers never change what the chain decides."""

from __future__ import annotations

from megalaunch.launcher.accounting.evidence import TaskEnd, lost_nodes
from megalaunch.launcher.accounting.nodes import (
    ExclusionPlan,
    NodeHealth,
    attribute,
    current_plan,
    health_evidence,
)
from megalaunch.launcher.chain.backend import Echo, JobControl
from megalaunch.rundir.hostlist import expand_hostlist
from megalaunch.rundir.ledger import Ledger
from megalaunch.rundir.paths import RunPaths
from megalaunch.runtime.rank.settings import RuntimeSettings


class Suspects:
    """One run's bad-node decisions, recorded in its ledger and told through `log`."""

    def __init__(self, paths: RunPaths, settings: RuntimeSettings, ledger: Ledger, scheduler: JobControl,
                 log: Echo) -> None:
        self.paths = paths
        self.settings = settings
        self.ledger = ledger
        self.scheduler = scheduler
        self.log = log

    def _node_health(self) -> NodeHealth | None:
        d = self.settings.node_health_dir
        return NodeHealth(d) if d else None

    def after_failure(self, job_id: str, ends: list[TaskEnd], nodes: list[str]) -> None:
        """A failed segment (on `nodes`): record the node(s) it points at in the team's node-health ledger."""
        if (health := self._node_health()) is None:
            return
        att = attribute(ends, self.paths.segment_log(job_id), nodes)
        self._record(health, job_id, [(node, att.reason, ev) for node, ev in att.suspects.items()])

    def after_health_check(self, job_id: str, outcome: dict[str, object]) -> None:
        """A segment the health check ended (runtime/health/health.py): its unhealthy node(s) become suspect,
        with every rank's figures on them as the evidence."""
        health, check = self._node_health(), outcome.get("health_check")
        if health is None or not isinstance(check, dict):
            return
        suspects = []
        for node in check.get("unhealthy_nodes") or []:
            evidence = [health_evidence(r, check) for r in check.get("ranks") or [] if r.get("node") == node]
            suspects.append((str(node), "health check: " + "; ".join(evidence[:4]), evidence))
        self._record(health, job_id, suspects)

    def after_passed_check(self, job_id: str, outcome: dict[str, object]) -> None:
        """A suspect node that passed this segment's health check is one again: cleared from the node-health
        ledger (a node that died and came back is excluded until then, or until `megalaunch nodes clear`)."""
        health, check = self._node_health(), outcome.get("health_check")
        if health is None or not isinstance(check, dict):
            return
        ranks = [r for r in check.get("ranks") or [] if isinstance(r, dict)]
        checked = set(expand_hostlist(str(check.get("nodes") or ""))) | {str(r.get("node")) for r in ranks}
        passed = checked - {str(n) for n in check.get("unhealthy_nodes") or []}
        try:
            suspect = health.active()
        except OSError:
            return
        for node in sorted(passed & set(suspect)):
            reason = f"passed the health check of job {job_id}"
            try:
                health.clear(node, reason=reason)
            except OSError as e:
                self.log(f"could not clear node {node} in {health.file}: {e}")
                continue
            self.ledger.append("node_cleared", job_id=job_id, node=node, reason=reason)
            self.log(f"node {node} is no longer suspect: {reason}")

    def after_node_failure(self, job_id: str, slurm_state: str | None) -> list[str]:
        """A segment that vanished (no `job end`): if Slurm ended it NODE_FAIL, the node(s) it lost: those
        srun named in its log (`Node failure on X`), else its batch host, whose death takes srun and the
        job script with it, so nothing is printed. They become suspects, as a node lost inside a job
        does (restart.py): the successors exclude them, even once they are back, until they pass a health
        check or are cleared."""
        if slurm_state != "NODE_FAIL":
            return []
        lost = lost_nodes(self.paths.segment_log(job_id))
        how = "srun: node failure"
        if not lost:
            try:
                host = self.scheduler.batch_host(job_id)
            except Exception as e:  # Slurm did not answer: nothing to blame
                self.log(f"segment {job_id} ended NODE_FAIL; its batch host is unknown ({e})")
                return []
            lost, how = ([host] if host else []), "its batch host (the job script's node) was lost"
        if lost:
            self.record_lost(job_id, lost, f"job {job_id} ended NODE_FAIL: {how}")
        return lost

    def record_lost(self, job_id: str, nodes: list[str], reason: str) -> None:
        """Nodes a job lost outright (no `job end` to say so): suspects, with `reason` as the evidence."""
        if (health := self._node_health()) is not None:
            self._record(health, job_id, [(node, reason, [reason]) for node in nodes])

    def _record(self, health: NodeHealth, job_id: str, suspects: list[tuple[str, str, list[str]]]) -> None:
        """(node, reason, evidence) each into the node-health ledger and the run's ledger."""
        for node, reason, evidence in suspects:
            try:
                s = health.suspect(node, reason=reason, evidence=evidence, run=self.paths.root.name,
                                   job_id=job_id, ttl_s=self.settings.suspect_ttl_s)
            except OSError as e:  # the ledger must never change what the chain does
                self.log(f"could not record suspect node {node} in {health.file}: {e}")
                continue
            self.ledger.append("node_suspected", job_id=job_id, node=node, reason=reason, evidence=evidence,
                               expires=s.expires, ledger=str(health.file))
            self.log(f"suspect node {node}: {reason}")

    def plan(self) -> ExclusionPlan | None:
        """Which suspect nodes a successor excludes now (None: exclusion off, or nothing suspect)."""
        return current_plan(self.settings, self.scheduler.known_nodes, self.log)

    def record_exclusion(self, successor: str, plan: ExclusionPlan) -> None:
        self.ledger.append("exclusion", job_id=successor, excluded=plan.exclude, kept=plan.kept)
        self.log(f"successor {successor} {plan.describe()}")

    def exclude_from(self, successors: list[str]) -> None:
        """The successors were queued when this segment began: exclude what is suspect now."""
        plan = self.plan()
        if plan is None:
            return
        for successor in successors:
            if plan.exclude:
                try:
                    self.scheduler.exclude([successor], plan.exclude)
                except Exception as e:  # Slurm did not answer: the successor runs as queued
                    self.log(f"could not exclude {', '.join(plan.exclude)} from {successor}: {e}")
                    self.ledger.append("exclusion", job_id=successor, excluded=[], kept={
                        n: f"scontrol update failed: {e}" for n in plan.exclude} | plan.kept)
                    continue
            self.record_exclusion(successor, plan)
