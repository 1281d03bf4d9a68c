//! The counting allocator's count when many threads allocate at once (its counters are
//! shared out among the threads: `src/memory.rs`): bytes allocated on one thread and
//! freed on another, by many threads side by side, leave the count where it started, and
//! a buffer's bytes show in the count and in the peak of a measurement around it. One
//! test in this binary: the count is the whole process's.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Barrier;

use gradcache::memory::{current_bytes, measure, CountingAllocator, PEAK_CHECK};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

const THREADS: usize = 16;

/// What a thread hands the next: the vectors it made.
type Made = Vec<Vec<u32>>;

/// Sixteen threads side by side, each making small vectors (and growing a string: a
/// reallocation) that the next thread frees, so a thread's own counter goes below zero.
fn pass_around() {
    let (senders, receivers): (Vec<Sender<Made>>, Vec<Receiver<Made>>) =
        (0..THREADS).map(|_| channel()).unzip();
    let start = Barrier::new(THREADS);
    std::thread::scope(|s| {
        for (t, rx) in receivers.into_iter().enumerate() {
            let (tx, start) = (senders[(t + 1) % THREADS].clone(), &start);
            s.spawn(move || {
                start.wait();
                let mut text = String::new();
                let made: Made = (0..2_000)
                    .map(|i| {
                        text.push_str("token ");
                        vec![i as u32; 1 + i % 37]
                    })
                    .collect();
                tx.send(made).unwrap();
                // Made by the thread before this one, freed here.
                drop(rx.recv().unwrap());
                std::hint::black_box(text);
            });
        }
    });
}

#[test]
fn the_count_stays_exact_across_threads() {
    // Once first: what the first use of threads and channels allocates and keeps (the
    // runtime's own) is not this test's to count.
    pass_around();
    let base = current_bytes();
    let (_, peak, held) = measure(|| {
        pass_around();
        // A buffer past the peak threshold, held when the measurement ends.
        vec![1u8; 4 * PEAK_CHECK]
    });
    let moved = current_bytes().wrapping_sub(base);
    assert_eq!(
        moved,
        held.len(),
        "the count moved by {} bytes where one buffer of {} is held",
        moved as isize,
        held.len()
    );
    assert!(
        peak >= held.len(),
        "peak {peak} below the buffer held ({})",
        held.len()
    );
    drop(held);
    assert_eq!(current_bytes(), base, "the count is back where it started");
}
