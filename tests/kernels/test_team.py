"""colibri.kernels.team, threads sharing out a phase's pieces: every piece done exactly once
before any thread leaves the phase, and no deadlock when the runtime runs the team's
iterations one after another (the whole-token decode on a real model: tests/models/test_token_layers.py)."""
import numpy as np
import pytest
from numba import get_num_threads, njit, prange, set_num_threads

from colibri.kernels.team import claim, counters_size, finish, unmanaged


@njit(parallel=True)
def _share_out(n_pieces, phases, nthreads, iterations):
    """`iterations` prange iterations acting as a team of nthreads (more iterations than pool
    threads run one after another); each phase's pieces are counted where they are done."""
    ctr = np.zeros(counters_size(phases, nthreads), np.int64)
    done = np.zeros((phases, n_pieces), np.int64)
    for t in prange(iterations):
        state = np.zeros(2, np.int64)
        for p in range(phases):
            state[0] = 0
            state[1] = 0
            while True:
                k = claim(ctr, p, n_pieces, nthreads, t % nthreads, state)
                if k < 0:
                    break
                done[p, k] += 1
            finish(ctr, p, n_pieces, nthreads, state)
            # After finish, every piece of this phase is done: nothing of it may be missing.
            for k in range(n_pieces):
                if done[p, k] == 0:
                    done[p, k] = -1000
    return done


@pytest.mark.parametrize("pool, nthreads", [(2, 2), (1, 2), (2, 3), (1, 1), (2, 1)])
@pytest.mark.parametrize("n_pieces", [1, 7, 64])
def test_each_piece_is_done_once_before_any_thread_leaves_its_phase(pool, nthreads, n_pieces):
    saved = get_num_threads()
    set_num_threads(min(pool, saved))
    try:  # pool 1: the iterations run one after another, the first doing every piece
        done = _share_out(n_pieces, 5, nthreads, nthreads)
    finally:
        set_num_threads(saved)
    assert (done == 1).all()


@njit
def _through_unmanaged(a):
    b = unmanaged(a)
    b[0] += 1.0
    return b.sum()


def test_an_unmanaged_view_reads_and_writes_the_same_memory():
    a = np.arange(5, dtype=np.float32)
    assert _through_unmanaged(a) == 11.0 and a[0] == 1.0


def test_run_team_runs_every_member_and_hands_back_a_helpers_error():
    from colibri.kernels.team import run_team

    seen = []
    run_team(lambda t, tag: seen.append((t, tag)), 3, "x")
    assert sorted(seen) == [(0, "x"), (1, "x"), (2, "x")]

    def fail_in_helper(t):
        if t == 1:
            raise ValueError("member 1")

    with pytest.raises(ValueError, match="member 1"):
        run_team(fail_in_helper, 2)
    seen.clear()
    run_team(lambda t: seen.append(t), 2)  # the helpers are still there after an error
    assert sorted(seen) == [0, 1]
