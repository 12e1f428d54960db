"""A Water-like N-body time step: pairwise forces reduced into shared arrays under locks, in fixed point.

    ckpt launch -n 4 dsm/programs/water.py [MOLECULES=96] [STEPS=6] [BLOCKS=8]

Molecules (one Lennard-Jones site each, on a jittered cubic lattice, reduced
units) keep their positions and velocities in shared arrays; each rank owns
a band of molecules (and is the home of its pages, first touch: where a page
holds several bands, whoever touches it first).  One step is one time step.  Each rank
computes the force of every pair (i, j > i) with i in its band, within a
cut-off, and the pair's energy, rounded to multiples of 2**-20 as int64 (so
sums are exact and independent of order), into a private buffer; then, block
by block (BLOCKS blocks of molecules, one lock each, starting at its own), it
adds the buffer into the shared force array under the block's lock, and its
energy under the energy lock; barrier.  Each rank then moves its own
molecules (a symplectic Euler kick and drift from the fixed-point force)
and clears their forces; barrier.  Integer sums make the lock order
irrelevant: the positions and the energies compare bit for bit with the same
fixed-point algorithm in plain numpy.
"""

from __future__ import annotations

import numpy as np

import ckpt
import dsm
from dsm.programs._common import answer_or_raise, args, band, verdict

SEED = 13
SCALE = 2.0**20  # fixed point: forces and energies are multiples of 1 / SCALE
SPACING = 1.2  # lattice constant (the pair potential's minimum is at 2**(1/6) ~ 1.12)
CUTOFF2 = 2.5**2
DT = 0.002


def initial(molecules: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions on a jittered cubic lattice and small random velocities."""
    rng = np.random.default_rng(SEED)
    side = int(np.ceil(molecules ** (1 / 3)))
    grid = np.stack(np.meshgrid(*[np.arange(side)] * 3, indexing="ij"), axis=-1).reshape(-1, 3)[:molecules]
    pos = grid * SPACING + rng.uniform(-0.05, 0.05, (molecules, 3))
    vel = rng.uniform(-0.5, 0.5, (molecules, 3))
    return pos, vel


def pair_forces(pos: np.ndarray, i: int) -> tuple[np.ndarray, int]:
    """Fixed-point forces on molecule i from molecules i+1.. (rows, int64) and the energy of those pairs.

    Only +, -, *, / (correctly rounded, so the same bits vectorised or not), and element-wise.
    """
    dx = pos[i, 0] - pos[i + 1 :, 0]
    dy = pos[i, 1] - pos[i + 1 :, 1]
    dz = pos[i, 2] - pos[i + 1 :, 2]
    r2 = dx * dx + dy * dy + dz * dz
    near = r2 < CUTOFF2
    inv2 = np.where(near, 1.0 / r2, 0.0)
    inv6 = inv2 * inv2 * inv2
    scalar = 24.0 * inv6 * (2.0 * inv6 - 1.0) * inv2  # |F| / r for 4 (r**-12 - r**-6)
    force = np.stack((scalar * dx, scalar * dy, scalar * dz), axis=1)
    energy = np.rint(4.0 * inv6 * (inv6 - 1.0) * SCALE).astype(np.int64)
    return np.rint(force * SCALE).astype(np.int64), int(np.sum(energy))


def forces(pos: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, int]:
    """The fixed-point forces of the pairs (i, j > i) with lo <= i < hi on all molecules, and their energy."""
    total = np.zeros(pos.shape, dtype=np.int64)
    energy = 0
    for i in range(lo, min(hi, pos.shape[0] - 1)):
        f, e = pair_forces(pos, i)
        total[i] += np.sum(f, axis=0)
        total[i + 1 :] -= f
        energy += e
    return total, energy


def move(pos: np.ndarray, vel: np.ndarray, force: np.ndarray) -> None:
    """Kick and drift in place (unit masses): v += F dt, x += v dt."""
    vel += force.astype(np.float64) / SCALE * DT
    pos += vel * DT


def reference(molecules: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Plain numpy: the final positions and every step's energy."""
    pos, vel = initial(molecules)
    energies = np.zeros(steps, dtype=np.int64)
    for s in range(steps):
        force, energies[s] = forces(pos, 0, molecules)
        move(pos, vel, force)
    return pos, energies


def outcome(pos: np.ndarray, energies: np.ndarray) -> np.ndarray:
    """What is compared: the positions, then the energies (as float64: exact while below 2**53 / SCALE)."""
    return np.concatenate((pos.ravel(), energies.astype(np.float64) / SCALE))


class Water(ckpt.Program):
    def setup(self, rt: ckpt.Runtime) -> None:
        self.molecules, self.steps, self.blocks = args(rt, [96, 6, 8])
        if self.molecules < 1 or self.steps < 1 or self.blocks < 1:
            raise ValueError("water needs MOLECULES, STEPS and BLOCKS of at least 1")
        self.mem = dsm.attach(rt)
        self.pos = self.mem.array((self.molecules, 3))
        self.vel = self.mem.array((self.molecules, 3))
        self.force = self.mem.array((self.molecules, 3), np.int64)
        self.energy = self.mem.array(self.steps, np.int64)
        self.block_locks = [self.mem.lock() for _ in range(self.blocks)]
        self.energy_lock = self.mem.lock()
        lo, hi = band(self.molecules, rt.rank, rt.size)
        pos, vel = initial(self.molecules)
        rows = (slice(lo, hi), slice(None))
        for shared, value in ((self.pos, pos[lo:hi]), (self.vel, vel[lo:hi]), (self.force, 0)):
            if lo < hi:
                with shared.write(rows) as v:  # first touch: this rank is home of its band's pages
                    v[:] = value
        if rt.rank == 0:
            with self.energy.write(...) as v:
                v[:] = 0
        self.mem.barrier()
        self.it = 0
        self.answer: str | None = None

    def step(self, rt: ckpt.Runtime) -> bool:
        lo, hi = band(self.molecules, rt.rank, rt.size)
        mine, energy = forces(self.pos[...], lo, hi)
        first = rt.rank * self.blocks // rt.size  # start at a different block on every rank
        for k in range(self.blocks):
            b = (first + k) % self.blocks
            b0, b1 = band(self.molecules, b, self.blocks)
            if b0 < b1 and np.any(mine[b0:b1]):
                with self.block_locks[b], self.force.write((slice(b0, b1), slice(None))) as v:
                    v += mine[b0:b1]
        with self.energy_lock:
            self.energy[self.it] += energy
        self.mem.barrier()  # every force is in
        if lo < hi:
            rows = (slice(lo, hi), slice(None))
            force = self.force[rows]
            with self.pos.write(rows) as p, self.vel.write(rows) as v:
                move(p, v, force)
            with self.force.write(rows) as f:
                f[:] = 0
        self.mem.barrier()  # every molecule has moved
        self.it += 1
        if self.it < self.steps:
            return True
        pos, energies = reference(self.molecules, self.steps)
        self.answer = verdict("water", outcome(self.pos[...], self.energy[...]), outcome(pos, energies), exact=True)
        return False

    def result(self) -> str:
        return str(answer_or_raise(self.answer))
