//! The counting allocator's count when many threads allocate at once (its counters are
//! shared out among the threads: `src/memory.rs`): bytes allocated on one thread and
//! freed on another, by many threads side by side, leave the count where it started, and
//! a buffer's bytes show in the count and in the peak of a measurement around it. The
//! count is the whole process's: the test holds the binary's lock (`main.rs`).

use std::sync::{Barrier, Mutex};

use gradcache::memory::{current_bytes, measure, PEAK_CHECK};

use crate::alone;

const THREADS: usize = 16;

/// What a thread hands the next: the vectors it made.
type Made = Vec<Vec<u32>>;

#[test]
fn the_count_stays_exact_across_threads() {
    let _alone = alone();
    // Sixteen threads, started before the count is read and still alive when it is read
    // again (a thread's start and end allocate and free what the runtime keeps for it),
    // each making small vectors (and growing a string: a reallocation) that the next
    // thread frees, so a thread's own counter goes below zero.
    let handed: Vec<Mutex<Option<Made>>> = (0..THREADS).map(|_| Mutex::new(None)).collect();
    let [ready, go, done, exit] = std::array::from_fn(|_| Barrier::new(THREADS + 1));
    let swapped = Barrier::new(THREADS);
    let (base, peak, held_len, after, back) = std::thread::scope(|s| {
        for t in 0..THREADS {
            let (handed, swapped) = (&handed, &swapped);
            let (ready, go, done, exit) = (&ready, &go, &done, &exit);
            s.spawn(move || {
                ready.wait();
                go.wait();
                let mut text = String::new();
                // Each thread a different amount: a thread's own counter ends at what it
                // made less what it freed, tens of KiB away from zero.
                let made: Made = (0..500 * (t + 1))
                    .map(|i| {
                        text.push_str("token ");
                        vec![i as u32; 1 + i % 37]
                    })
                    .collect();
                *handed[t].lock().unwrap() = Some(made);
                swapped.wait();
                // Made by the next thread, freed here.
                drop(handed[(t + 1) % THREADS].lock().unwrap().take());
                drop(std::hint::black_box(text));
                done.wait();
                exit.wait();
            });
        }
        ready.wait();
        let base = current_bytes();
        let (_, peak, held) = measure(|| {
            go.wait();
            done.wait();
            // A buffer past the peak threshold, held when the measurement ends.
            vec![1u8; 4 * PEAK_CHECK]
        });
        let after = current_bytes();
        let held_len = held.len();
        drop(held);
        let back = current_bytes();
        // Asserted once the threads are gone (a panic here would leave them waiting).
        exit.wait();
        (base, peak, held_len, after, back)
    });
    // The test harness's own thread may allocate meanwhile (a blocking wait's first
    // use allocates its bookkeeping): a few hundred bytes at most; a slot left out of
    // the sum would move the count by tens of KiB.
    const SLACK: isize = 4 << 10;
    let moved = after.wrapping_sub(base) as isize;
    assert!(
        (moved - held_len as isize).abs() <= SLACK,
        "the count moved by {moved} bytes where one buffer of {held_len} is held"
    );
    assert!(
        peak >= held_len,
        "peak {peak} below the buffer held ({held_len})"
    );
    let back = back.wrapping_sub(base) as isize;
    assert!(
        back.abs() <= SLACK,
        "the count ends {back} bytes from where it started"
    );
}
