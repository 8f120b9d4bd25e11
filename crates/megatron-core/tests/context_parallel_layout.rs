//! `CpLayout`'s cutting of whole sequences into each context-parallel rank's two chunks, and
//! its inverse over the group.

use megatron_core::context_parallel::CpLayout;

#[test]
fn each_ranks_chunks_gathered_in_rank_order_give_back_the_whole_sequences() {
    let (b, size, t) = (2, 3, 12);
    let full: Vec<u32> = (0..(b * t) as u32).collect();
    let all: Vec<u32> = (0..size)
        .flat_map(|rank| CpLayout { rank, size }.batch_on_this_rank(&full, b, t))
        .collect();
    // Rank 0 holds chunks 0 and 5 (of 2 tokens) of each sequence.
    assert_eq!(&all[..4], &[0, 1, 10, 11]);
    let back = CpLayout { rank: 1, size }.batch_from_ranks(&all, b, t / size);
    assert_eq!(back, full);
}
