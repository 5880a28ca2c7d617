"""The library of python -m dspark.schedule: the throughput / interactivity frontier of the
verification-length policies (paper §5.3-5.4, Figs. 7-8) over concurrency R.

  checks   the config, the sweep's policies, the cost model, before any model loads
  modes    analytical (replay recorded rounds, dspark.scheduling.replay), measured (run the
           engine, dspark.bench.measure; profile a cost table first when none is given) or e2e
           (the rows of a python -m dspark.bench.e2e run)
  outputs  frontier.json, the Fig. 7 / Fig. 8 plots, meta.json (a FrontierFolder)
"""

from .checks import check_config
from .modes import run_analytical, run_e2e, run_measured
from .outputs import write_outputs

__all__ = ["check_config", "run_analytical", "run_e2e", "run_measured", "write_outputs"]
