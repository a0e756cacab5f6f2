use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use super::*;

/// Every index of every region runs once, whatever the count (ragged ones, fewer than the
/// threads, thousands), regions back to back within a step and one at a time outside any.
#[test]
fn every_index_runs_once() {
    let counts = [0, 1, 2, 3, 7, 16, 17, 100, 1_000, 4_099];
    let check = |n: usize| {
        let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
        for_each(n, |i| {
            hits[i].fetch_add(1, Relaxed);
        });
        assert!(hits.iter().all(|h| h.load(Relaxed) == 1), "n = {n}");
    };
    step(|| {
        for _ in 0..50 {
            counts.iter().for_each(|&n| check(n));
        }
    });
    counts.iter().for_each(|&n| check(n));
}

/// A region started inside a task runs there, in order, and the outer region still runs each
/// of its indices once.
#[test]
fn a_region_inside_a_task_runs_on_its_thread_in_order() {
    let outer = map(64, |i| {
        let me = std::thread::current().id();
        let inner = map(10, |j| (std::thread::current().id(), i * 100 + j));
        assert!(inner.iter().all(|&(t, _)| t == me));
        inner.iter().map(|&(_, v)| v).sum::<usize>()
    });
    let expected: Vec<usize> = (0..64).map(|i| 1000 * i + 45).collect();
    assert_eq!(outer, expected);
}

/// Chunks cover the slices exactly, the last one short.
#[test]
fn chunks_cover_their_slices() {
    let mut a = vec![0usize; 1_003];
    let mut b = vec![0u8; 2 * 101];
    let mut c = vec![0i32; 101];
    for_chunks(&mut a, 10, |i, chunk| {
        assert!(chunk.len() == 10 || (i == 100 && chunk.len() == 3));
        chunk.iter_mut().for_each(|x| *x += i + 1);
    });
    assert!(a.iter().enumerate().all(|(k, &x)| x == k / 10 + 1));
    for_chunks3((&mut a, 10), (&mut b, 2), (&mut c, 1), |i, a, b, c| {
        b.fill(i as u8);
        c[0] = a.len() as i32;
    });
    assert!(b.chunks(2).enumerate().all(|(i, x)| x == [i as u8; 2]));
    assert_eq!(c[100], 3);
    assert!(c[..100].iter().all(|&x| x == 10));
}

/// A task's panic reaches the step's caller, after every other task ran, and the team works
/// on afterwards.
#[test]
fn a_panic_in_a_task_reaches_the_caller_and_the_team_goes_on() {
    let ran = AtomicUsize::new(0);
    let caught = std::panic::catch_unwind(AssertUnwindSafe(|| {
        for_each(200, |i| {
            ran.fetch_add(1, Relaxed);
            assert!(i != 123, "task 123 fails");
        })
    }));
    let message = caught.expect_err("the panic was lost");
    let text = message.downcast_ref::<&str>().copied();
    assert_eq!(text, Some("task 123 fails"));
    assert_eq!(ran.load(Relaxed), 200);
    assert!(!LEADING.get() && !IN_TASK.get());
    assert_eq!(
        map(300, |i| i * 2),
        (0..300).map(|i| i * 2).collect::<Vec<_>>()
    );
}

/// Several threads' steps run one after another and each gets its own results.
#[test]
fn steps_from_several_threads_do_not_mix() {
    std::thread::scope(|s| {
        let runs: Vec<_> = (0..4)
            .map(|k| {
                s.spawn(move || {
                    (0..100).all(|r| {
                        let n = 50 + k * 13 + r;
                        step(|| map(n, |i| i * k + r))
                            == (0..n).map(|i| i * k + r).collect::<Vec<_>>()
                    })
                })
            })
            .collect();
        assert!(runs.into_iter().all(|h| h.join().unwrap()));
    });
}

/// An underflowing product and a subnormal operand are zero on every thread of a step, the
/// leader's included, and what IEEE says on the leader's thread once its step ends and on a
/// thread outside the team.
#[test]
#[cfg(target_arch = "x86_64")]
fn a_steps_threads_flush_subnormals_and_others_do_not() {
    let tiny = f32::from_bits(1); // the smallest subnormal
    let ieee = black_box(1e-30f32) * black_box(1e-10f32);
    assert!(ieee > 0.0 && ieee < f32::MIN_POSITIVE, "{ieee:e}");
    let normal = black_box(1e-20f32) * black_box(1e-10f32);
    let on_team: Vec<(f32, f32, f32)> = step(|| {
        map(4096, |_| {
            (
                black_box(1e-30f32) * black_box(1e-10f32),
                black_box(tiny) * black_box(1.0f32),
                black_box(1e-20f32) * black_box(1e-10f32),
            )
        })
    });
    let wrong = on_team
        .iter()
        .find(|&&(p, q, n)| p != 0.0 || q != 0.0 || n != normal);
    assert!(wrong.is_none(), "{wrong:?}");
    assert_eq!(
        black_box(1e-30f32) * black_box(1e-10f32),
        ieee,
        "the leader's mode stayed"
    );
    let outside = std::thread::spawn(|| black_box(1e-30f32) * black_box(1e-10f32));
    assert_eq!(outside.join().unwrap(), ieee);
}

/// `zeros` clears memory the heap hands back after another buffer used it, at every size
/// around its task's length (a partial last task included).
#[test]
fn zeros_are_zeros_in_reused_memory() {
    for n in [
        0,
        1,
        1000,
        (64 << 10) - 1,
        64 << 10,
        (64 << 10) + 1,
        1_000_003,
    ] {
        drop(black_box(vec![7.5f32; n]));
        let z = step(|| zeros(n));
        assert_eq!(z.len(), n);
        assert!(z.iter().all(|&v| v.to_bits() == 0), "n = {n}");
    }
}
