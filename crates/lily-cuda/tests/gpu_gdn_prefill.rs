//! The prefill Gated DeltaNet kernels (conv, the token scan, gated norm over a chunk) against a
//! CPU reference built from lily-cpu's delta rule, starting from a non-zero conv window and state
//! as after an earlier chunk; and the two delta-rule routes timed by length. The chunked route's
//! correctness is in gpu_gdn_chunked.rs. These need a CUDA GPU: ignored by a plain `cargo test`,
//! run on the H200 with `--include-ignored`. Every comparison prints its measured error.

#[path = "support/gdn_layer.rs"]
mod gdn_layer;
mod support;

use cudarc::driver::CudaSlice;
use gdn_layer::*;
use lily_core::config::ModelConfig;
use lily_cuda::KvPrecision;
use lily_cuda::gdn_prefill::{GdnPrefillRoute, conv_rows, gated_norm_rows, scan, scratch_floats};
use lily_cuda::gpu::{Gpu, ptr};
use support::{NEEDS_GPU, rel_diff, time_ms};

const LENGTHS: [usize; 6] = [1, 2, 7, 33, 200, 1000];

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_chunk_matches_the_cpu_reference() {
    for (nk, nv, dk, dv) in SHAPES {
        let c = config(nk, nv, dk, dv);
        let gpu = Gpu::new(&c, KvPrecision::F32).expect(NEEDS_GPU);
        let w = Layer::random(&c, 10);
        for t in LENGTHS {
            let start = Carried::random(&c, 20 + t as u64);
            let (proj, ld) = proj_rows(&c, t, 30 + t as u64);
            let d = DeviceLayer::upload(&gpu, &w, &start);
            let got = run_chunk(&gpu, &c, &d, &proj, ld, t);
            let mut want_carried = start;
            let want = reference(&c, &w, &proj, ld, t, &mut want_carried);
            let label = format!("NK {nk} NV {nv} DK {dk} DV {dv}, T {t}");
            check(&label, (&got, &d.carried(&gpu)), (&want, &want_carried));
        }
    }
}

/// Chunks T1 then T2 leave what one chunk of T1 + T2 does, including T1 shorter than the conv
/// window (old window rows mixed into the new one).
#[test]
#[ignore = "needs a CUDA GPU"]
fn two_chunks_equal_one() {
    for (nk, nv, dk, dv) in SHAPES {
        let c = config(nk, nv, dk, dv);
        let gpu = Gpu::new(&c, KvPrecision::F32).expect(NEEDS_GPU);
        let w = Layer::random(&c, 40);
        for (t1, t2) in [(1, 1), (2, 5), (1, 40), (33, 167), (600, 400)] {
            let t = t1 + t2;
            let start = Carried::random(&c, 50 + t1 as u64);
            let (proj, ld) = proj_rows(&c, t, 60 + t2 as u64);

            let whole = DeviceLayer::upload(&gpu, &w, &start);
            let one = run_chunk(&gpu, &c, &whole, &proj, ld, t);
            let one_carried = whole.carried(&gpu);

            let split = DeviceLayer::upload(&gpu, &w, &start);
            let first = run_chunk(&gpu, &c, &split, &proj, ld, t1);
            let second = run_chunk(&gpu, &c, &split, &proj[t1 * ld..], ld, t2);
            let two = Outputs {
                conv: [first.conv, second.conv].concat(),
                o: [first.o, second.o].concat(),
                y: [first.y, second.y].concat(),
            };
            let two_carried = split.carried(&gpu);

            let label = format!("NK {nk} NV {nv} DK {dk} DV {dv}, T {t1} + {t2}");
            let bitwise = two.o == one.o && two_carried.state == one_carried.state;
            eprintln!("{label}: two chunks bitwise equal to one: {bitwise}");
            // Each token runs the same operations in the same order either way, so the two
            // should agree to the bit; 1e-6 allows a compiler's different instruction choice.
            for (what, a, b) in [
                ("conv", &two.conv, &one.conv),
                ("o", &two.o, &one.o),
                ("y", &two.y, &one.y),
                ("state", &two_carried.state, &one_carried.state),
            ] {
                let d = rel_diff(a, b);
                assert!(d <= 1e-6, "{label}: {what} differs by {d:e}");
            }
            assert!(
                two_carried.window == one_carried.window,
                "{label}: the conv window differs"
            );
            let mut want_carried = start;
            let want = reference(&c, &w, &proj, ld, t, &mut want_carried);
            check(&label, (&two, &two_carried), (&want, &want_carried));
        }
    }
}

/// One layer's GDN family at the production heads over chunks of 16 … 4,096 tokens, the delta
/// rule by each route (each timing includes `gdn_scan_prep`), timed: a record for choosing the
/// route by length (`CHUNKED_FROM_TOKENS` in gdn_prefill.rs), not a pass/fail (beyond finite outputs).
#[test]
#[ignore = "needs a CUDA GPU"]
fn delta_rule_speed_by_length() {
    let (nk, nv, dk, dv) = SHAPES[0];
    let c = config(nk, nv, dk, dv);
    let gpu = Gpu::new(&c, KvPrecision::F32).expect(NEEDS_GPU);
    for t in [16, 32, 64, 128, 256, 1024, 4096] {
        delta_rule_speed_at(&gpu, &c, t);
    }
}

fn delta_rule_speed_at(gpu: &Gpu, c: &ModelConfig, t: usize) {
    let w = Layer::random(c, 160);
    let d = DeviceLayer::upload(gpu, &w, &Carried::random(c, 170));
    let (proj, ld) = proj_rows(c, t, 180);
    let s = &gpu.stream;
    let p = |b: &CudaSlice<f32>| ptr(b, s);
    let dproj = gpu.upload(&proj).unwrap();
    let conv = gpu.zeros::<f32>(t * c.gdn_conv_dim()).unwrap();
    let prep = gpu
        .zeros::<f32>(scratch_floats(c, t, GdnPrefillRoute::Chunked))
        .unwrap();
    let o = gpu.zeros::<f32>(t * c.gdn_value_dim()).unwrap();
    let y = gpu.zeros::<f32>(t * c.gdn_value_dim()).unwrap();
    let conv_ms = time_ms(gpu, &|| {
        conv_rows(
            gpu,
            c,
            p(&dproj),
            ld,
            t,
            p(&d.conv_w),
            p(&d.window),
            p(&conv),
            None,
        )
        .unwrap()
    });
    let norm_ms = time_ms(gpu, &|| {
        let eps = c.rms_norm_eps;
        gated_norm_rows(gpu, c, p(&o), p(&dproj), ld, t, p(&d.norm), p(&y), eps).unwrap()
    });
    for route in [GdnPrefillRoute::Scan, GdnPrefillRoute::Chunked] {
        let ms = time_ms(gpu, &|| {
            scan(
                gpu,
                c,
                route,
                p(&conv),
                p(&dproj),
                ld,
                t,
                p(&d.a_log),
                p(&d.dt_bias),
                p(&prep),
                p(&d.state),
                p(&o),
            )
            .unwrap()
        });
        gpu.sync().unwrap();
        let finite = gpu.download(&o).unwrap().iter().all(|x| x.is_finite());
        eprintln!(
            "{route:?}: delta rule {ms:.3} ms, family (conv {conv_ms:.3} + this + norm \
             {norm_ms:.3}) {:.3} ms per layer at T {t}",
            conv_ms + ms + norm_ms
        );
        assert!(finite, "{route:?}: non-finite outputs");
    }
}
