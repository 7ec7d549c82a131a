"""Everything beside the product, by purpose; nothing in the library, the runtime or the services
imports these (an import contract holds it):

- demos: `make demo` and its kin (demo.py, demo_agent.py, demo_real.py, alfworld_demo.py), with the
  lines and commands they print (steps.py);
- studies and measurements behind docs/results (map.py, map_pack.py, pretrained_pilot.py,
  pretrained_study.py, crn_measure.py, tool_calls_study.py, toy_rl_probe.py, cold_start.py,
  alfworld_cold_start.py, chaos.py);
- repository checks (check_layout.py, check_links.py, lock.py);
- test helpers (toy_model.py, tiny_model.py, sink.py, tracker_process.py).
"""
