//! The row-block loss bounds memory: each block holds only its own `block x P` logits and
//! their graph, in both directions of the symmetric loss, so the loss's peak grows
//! linearly with the batch (the `[B, d]` representations and their gradients), never with
//! `B x B`. The counting allocator is process-wide, so no other test may run beside it:
//! the test holds the binary's lock (`main.rs`).

use candle_core::Tensor;
use gradcache::memory::measure;
use gradcache::{InfoNce, Loss, LossValue, Similarity};

use crate::alone;
use crate::common;
use crate::common::{max_diff, random};

const WIDTH: usize = 32;
const BLOCK: usize = 32;
/// Passages per query: a positive and one hard negative, so the symmetric term's anchors
/// are a strided subset of the passages.
const GROUP: usize = 2;

fn loss(block: Option<usize>) -> InfoNce {
    InfoNce::new(0.05)
        .unwrap()
        .with_similarity(Similarity::Cosine)
        .with_symmetric(true)
        .with_block_rows(block)
        .unwrap()
}

fn run(queries: usize, block: Option<usize>) -> (usize, LossValue) {
    let q = random(1, &[queries, WIDTH]);
    let p = random(2, &[queries * GROUP, WIDTH]);
    let l = loss(block);
    let (_, peak, value) = measure(|| l.value_and_grads(&q, &p));
    (peak, value.unwrap())
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    max_diff(a, b) / common::max_abs(b)
}

#[test]
fn row_block_loss_memory_is_linear_in_the_batch() {
    let _alone = alone();
    let (small, _) = run(512, Some(BLOCK));
    let (large, blocked) = run(1024, Some(BLOCK));
    let ratio = large as f64 / small as f64;
    // Doubling the batch doubles the representations, their gradients and one block's
    // logits row length (linear: ratio 2); holding every block's logits or a B x B
    // gradient would quadruple it.
    assert!(
        ratio < 2.6,
        "peak {small} B at 512 queries, {large} B at 1024: ratio {ratio:.2} (quadratic?)"
    );
    // An absolute bound: the inputs and gradients (4 x [B(k+1), d] floats at most) plus a
    // few dozen block-sized temporaries, far below one B x B(k+1) logits matrix.
    let p_rows = 1024 * GROUP;
    let bound = 4 * (8 * p_rows * WIDTH + 40 * BLOCK * p_rows);
    let full_logits = 4 * 1024 * p_rows;
    assert!(
        large < bound && large < full_logits,
        "peak {large} B exceeds {bound} B (one full logits matrix: {full_logits} B)"
    );

    // And the blocks compute what the one-block form computes.
    let (_, whole) = run(1024, None);
    assert!(((blocked.loss - whole.loss) / whole.loss).abs() < 1e-5);
    let eq = rel(&blocked.grad_queries, &whole.grad_queries);
    let ep = rel(&blocked.grad_passages, &whole.grad_passages);
    assert!(eq < 1e-5 && ep < 1e-5, "gradients differ: {eq:e} {ep:e}");
    assert_eq!(blocked.grad_passages.dims(), &[1024 * GROUP, WIDTH]);
}
