//! `torch.randperm(n, generator=torch.Generator().manual_seed(seed))` on the CPU, reproduced
//! exactly: Megatron's cyclic sampler (`MegatronPretrainingRandomSampler`) draws each epoch's
//! sample order with it, so a run here reads the samples Megatron-LM reads.
//!
//! Torch's CPU generator is the standard MT19937 seeded by `init_genrand` with the low 32 bits
//! of the seed, the engine numpy's legacy `RandomState` also uses ([`RandomState`]). Below
//! `u32::MAX / 20` elements torch shuffles `0..n` by Fisher-Yates from the front, each swap
//! partner `i + next_u32() % (n - i)`; from there on it builds the permutation inside-out from
//! 64-bit draws (two 32-bit draws, the first the high half), `z = next_u64() % (i + 1)`.
//! Checked against torch 2.15 on both sides of the threshold (tests/torch_randperm.rs).

use crate::numpy_rng::RandomState;

/// The length from which torch switches to the inside-out variant with 64-bit draws.
pub const INSIDE_OUT_FROM: u64 = u32::MAX as u64 / 20;

/// The permutation as `u32`s (half the memory of torch's `int64`): a sampler's bucket holds
/// at most `u32::MAX + 1` samples, which callers check before asking (Megatron builds
/// the same list in Python, at 8 bytes a pointer and more an integer).
pub fn torch_randperm(n: u64, seed: u64) -> Vec<u32> {
    assert!(
        n <= u32::MAX as u64 + 1,
        "randperm of {n} elements: callers keep buckets within u32 indices"
    );
    let mut rng = RandomState::new(seed as u32);
    if n < INSIDE_OUT_FROM {
        let mut r: Vec<u32> = (0..n as u32).collect();
        for i in 0..n.saturating_sub(1) {
            let z = rng.next_u32() as u64 % (n - i);
            r.swap(i as usize, (i + z) as usize);
        }
        return r;
    }
    let mut r = vec![0u32; n as usize];
    for i in 0..n {
        let z = (rng.next_u64() % (i + 1)) as usize;
        r[i as usize] = r[z];
        r[z] = i as u32;
    }
    r
}
