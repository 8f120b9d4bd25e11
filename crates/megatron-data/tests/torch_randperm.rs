//! `torch_randperm` against torch 2.15's own `torch.randperm(n, generator=manual_seed(seed))`.
//! The expected values were printed by torch (the commands are in each test's comment).

use megatron_data::torch_randperm::{torch_randperm, INSIDE_OUT_FROM};

/// `sum(i * p[i])`, which tells any two permutations of the same length apart in practice.
fn weighted(p: &[u32]) -> u64 {
    p.iter()
        .enumerate()
        .map(|(i, &v)| i as u64 * v as u64)
        .sum()
}

#[test]
fn randperm_matches_torch_below_the_inside_out_threshold() {
    // g = torch.Generator(); g.manual_seed(s); torch.randperm(n, generator=g).tolist()
    let cases: [(u64, u64, &[u32], u64); 6] = [
        (1, 0, &[0], 0),
        (2, 0, &[0, 1], 1),
        (5, 0, &[4, 0, 1, 3, 2], 19),
        (10, 3, &[6, 0, 3, 7, 8, 5, 1, 9, 2, 4], 205),
        (37, 1, &[30, 24, 6, 11, 29, 14, 27, 18, 15, 33, 0, 1], 11410),
        (
            1000,
            7,
            &[615, 284, 599, 580, 347, 92, 383, 891, 452, 41, 998, 773],
            251_046_965,
        ),
    ];
    for (n, seed, head, sum) in cases {
        let p = torch_randperm(n, seed);
        assert_eq!(&p[..head.len()], head, "randperm({n}) seeded {seed}");
        assert_eq!(weighted(&p), sum, "randperm({n}) seeded {seed}");
    }
}

#[test]
fn randperm_seeds_with_the_low_32_bits_as_torch() {
    // torch's manual_seed(2**32 + 5) and manual_seed(5) give [1, 4, 9, 6, 3, 5, 0, 2, 8, 7].
    let want = [1, 4, 9, 6, 3, 5, 0, 2, 8, 7];
    assert_eq!(torch_randperm(10, 5), want);
    assert_eq!(torch_randperm(10, (1 << 32) + 5), want);
}

#[test]
fn randperm_matches_torch_from_the_inside_out_threshold() {
    // Torch builds permutations of u32::MAX / 20 elements and more inside-out from 64-bit
    // draws. At that length, seeded 1, torch printed p[[0, 1, 2, 3, 1000, 123456789, n-2, n-1]]
    // and sum(p * (arange(n) % 1000003)) as below (it takes 22 s; here 0.9 GB and ~12 s).
    // One below it (the front-to-back shuffle of the test above), torch gave p[0] = 73108941
    // and p[n-1] = 153835339, which this function matched too; not rerun, to spare CI.
    let n = INSIDE_OUT_FROM;
    let p = torch_randperm(n, 1);
    let idx = [0, 1, 2, 3, 1000, 123456789, n - 2, n - 1];
    let got: Vec<u32> = idx.iter().map(|&i| p[i as usize]).collect();
    assert_eq!(
        got,
        [81757386, 14531738, 31696440, 103595746, 31372397, 147376673, 129805825, 97769735],
        "randperm({n}) seeded 1"
    );
    let sum = p.iter().enumerate().fold(0u64, |acc, (i, &v)| {
        acc.wrapping_add(v as u64 * (i as u64 % 1_000_003))
    });
    assert_eq!(sum, 8198491397605761381, "randperm({n}) seeded 1");
}
