"""`fleetrl report`: plots and one HTML page from the metrics.jsonl of a run, a sweep, or several sweeps, with
across-seed means and 95% confidence intervals."""
from fleetrl.report.build import ReportResult, build_report

__all__ = ["ReportResult", "build_report"]
