"""The resilience benchmark keeps its server and its load generator on different CPUs."""

import os

import pytest

from genrec.benchmarks import resilience


def test_the_server_keeps_its_own_cpu_after_the_generator_pins_itself():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: server and generator share it")
    server, generator = resilience.server_cpus()
    assert server and generator and not set(server) & set(generator)
    try:
        os.sched_setaffinity(0, generator)  # what main does before it starts any server
        assert resilience.server_cpus() == (server, generator)  # not the generator's CPUs again
    finally:
        os.sched_setaffinity(0, cpus)
