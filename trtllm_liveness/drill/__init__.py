"""The drill: a real fault in the user's own model's engine, and what the extension did about it.

- :mod:`._drill_records`: the typed records that cross between the drill command and its engine
  process (one JSON object per line);
- :mod:`._drill_session`: the command's side: starts the engine process in a session of its own,
  reads its records, injects the fault by verified pid, and stops whatever it started;
- :mod:`._drill_engine`: the engine process (``python -m trtllm_liveness.drill._drill_engine``):
  the user's ``tensorrt_llm`` LLM API with the extension on, streaming requests;
- :mod:`._drill_faults`: across hosts, the engine's hub (:class:`DrillHub`) asks a rank's host's
  agent for the fault, which that agent's handler (:class:`AgentFaults`) makes;
- :mod:`._drill_hosts`: the launch across hosts and the rank of another host to hit.

``trtllm-liveness drill`` (:mod:`trtllm_liveness.cli._drill_command`) is the entry; nothing here is
imported until it runs.
"""
