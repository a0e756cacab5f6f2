//! Every kernel compiles with NVRTC for every supported architecture and for models of several
//! shapes (an architecture-specific file, such as the sm_90a wgmma GEMM, for its own GPU). Needs
//! libnvrtc but no GPU: CI installs the `nvidia-cuda-nvrtc` wheel (13.0 line) and runs this with
//! `--ignored` (scripts/test.sh).

use std::path::Path;

use lily_core::config::ModelConfig;
use lily_core::synthetic::synthetic_config;
use lily_cuda::compile::{KERNEL_FILES, KvPrecision, compile_all};
use lily_cuda::gpu::{RowInts, RowPtrs};
use lily_cuda::kernel_args::{ArgKind, entry_kinds};
use lily_cuda::mat::MatArg;

const ARCHS: [&str; 4] = ["sm_80", "sm_86", "sm_89", "sm_90"];

fn fixture_config(name: &str) -> ModelConfig {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name);
    ModelConfig::from_dir(&dir).unwrap()
}

#[test]
#[ignore = "needs libnvrtc.so.13 on LD_LIBRARY_PATH; scripts/test.sh installs it and runs this"]
fn every_kernel_compiles_for_every_architecture() {
    // A private cache directory, so the test compiles rather than reading earlier results.
    let cache = std::env::temp_dir().join(format!("lily-nvrtc-test-{}", std::process::id()));
    // SAFETY: set before any thread of this test binary reads the environment.
    unsafe { std::env::set_var("LILY_KERNEL_CACHE", &cache) };
    let models = [
        (
            "qwen3.6-35b-a3b",
            synthetic_config("qwen3.6-35b-a3b").unwrap(),
            &ARCHS[..],
        ),
        ("tiny", synthetic_config("tiny").unwrap(), &ARCHS[..]),
        ("tiny-a", fixture_config("tiny-a"), &ARCHS[3..]),
        ("tiny-b", fixture_config("tiny-b"), &ARCHS[3..]),
    ];
    for (name, config, archs) in models {
        for arch in archs {
            // The production bf16 cache everywhere; the f32 test variant on sm_90 too.
            let kvs: &[KvPrecision] = if *arch == "sm_90" {
                &[KvPrecision::Bf16, KvPrecision::F32]
            } else {
                &[KvPrecision::Bf16]
            };
            for &kv in kvs {
                let compiled = compile_all(&config, kv, arch, false)
                    .unwrap_or_else(|e| panic!("{name} for {arch}: {e:#}"));
                // Every file the GPU runs, the sm_90a-only ones included on sm_90.
                let expected: Vec<&str> = KERNEL_FILES
                    .iter()
                    .filter(|f| f.target(arch).is_some())
                    .map(|f| f.name)
                    .collect();
                let got: Vec<&str> = compiled.iter().map(|(f, _, _)| f.name).collect();
                assert_eq!(got, expected, "{name} for {arch}");
                for (file, target, ptx) in &compiled {
                    let text = ptx.to_src();
                    assert!(
                        text.contains(&format!(".target {target}")),
                        "{name}/{}: no {target} target",
                        file.name
                    );
                    // Every entry the launchers name must exist, or the backend fails at start.
                    for entry in file.entries {
                        assert!(
                            text.contains(&format!(".entry {entry}(")),
                            "{name}/{}: no kernel {entry}",
                            file.name
                        );
                    }
                }
                // Parameter kinds do not depend on the model or the cache precision.
                if name == "qwen3.6-35b-a3b" && *arch == "sm_90" && kv == KvPrecision::Bf16 {
                    let texts: Vec<String> = compiled.iter().map(|(_, _, p)| p.to_src()).collect();
                    every_argument_struct_matches_its_kernel(&texts);
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(cache);
}

/// Each entry point's parameters in PTX: `.param .u64`, `.u32` / `.s32`, `.f32`, or a struct as
/// `.b8 name[size]`.
fn ptx_params(text: &str, entry: &str) -> Option<Vec<ArgKind>> {
    let start = text.find(&format!(".entry {entry}("))?;
    let list = &text[start..start + text[start..].find(')')?];
    let struct_kind = |size: usize| {
        if size == std::mem::size_of::<MatArg>() {
            ArgKind::Mat
        } else if size == std::mem::size_of::<RowPtrs>() {
            ArgKind::Rows
        } else if size == std::mem::size_of::<RowInts>() {
            ArgKind::Ints
        } else {
            panic!("{entry}: a {size}-byte struct parameter no launch passes")
        }
    };
    let kinds = list
        .split(".param")
        .skip(1)
        .map(|p| {
            if p.contains(".u64") {
                ArgKind::U64
            } else if p.contains(".u32") || p.contains(".s32") {
                ArgKind::I32
            } else if p.contains(".f32") {
                ArgKind::F32
            } else {
                let size = p[p.find('[').expect("a struct size") + 1..p.find(']').expect("]")]
                    .parse()
                    .expect("a size");
                struct_kind(size)
            }
        })
        .collect();
    Some(kinds)
}

/// Each kernel's argument struct (kernel_args.rs) has the kinds of the compiled parameters, in
/// order, and every entry point that takes its arguments one by one has a struct: a field added,
/// dropped or swapped on one side shows here, without a GPU.
fn every_argument_struct_matches_its_kernel(texts: &[String]) {
    let structs = entry_kinds();
    for (entry, kinds) in &structs {
        let compiled = texts
            .iter()
            .find_map(|t| ptx_params(t, entry))
            .unwrap_or_else(|| panic!("no kernel {entry} for its argument struct"));
        assert_eq!(
            &compiled, kinds,
            "{entry}: the struct's kinds against the kernel's"
        );
    }
    for entry in KERNEL_FILES.iter().flat_map(|f| f.entries) {
        // The pick kernels take one PickArgs, checked by size below.
        if entry.starts_with("pick_") {
            continue;
        }
        assert!(
            structs.iter().any(|(e, _)| e == entry),
            "kernel {entry} has no argument struct in kernel_args.rs"
        );
    }
}

/// The persistent decode step compiles for every architecture, model shape and weight format
/// it is built for, and its one parameter has the size of the host's `DecArgs` (a field added
/// on one side only shows here, without a GPU).
#[test]
#[ignore = "needs libnvrtc.so.13 on LD_LIBRARY_PATH; scripts/test.sh installs it and runs this"]
fn the_persistent_decode_step_compiles_with_the_hosts_argument_layout() {
    use lily_cuda::compile::{DECODE_FILE, compile};
    use lily_cuda::decode::{StepFormats, args_bytes, step_defines, stream_warp_bytes};
    let cache = std::env::temp_dir().join(format!("lily-nvrtc-decode-{}", std::process::id()));
    // SAFETY: set before any thread of this test binary reads the environment.
    unsafe { std::env::set_var("LILY_KERNEL_CACHE", &cache) };
    let models = [
        (
            "qwen3.6-35b-a3b",
            synthetic_config("qwen3.6-35b-a3b").unwrap(),
        ),
        ("tiny", synthetic_config("tiny").unwrap()),
        ("tiny-a", fixture_config("tiny-a")),
    ];
    for (name, config) in models {
        for formats in [StepFormats::MLX_4BIT, StepFormats::DENSE] {
            // An A100's and an H100's shared memory a block.
            for (arch, optin) in [("sm_80", 166_912), ("sm_90", 232_448)] {
                let ring = stream_warp_bytes(optin).unwrap();
                let defines = step_defines(&config, KvPrecision::Bf16, &formats, ring);
                let ptx = compile(&DECODE_FILE, &defines, arch)
                    .unwrap_or_else(|e| panic!("{name} {formats:?} for {arch}: {e:#}"));
                let text = ptx.to_src();
                let param = format!(".param .align 8 .b8 decode_step_param_0[{}]", args_bytes());
                assert!(
                    text.contains(&param),
                    "{name}: decode_step's parameter is not {} bytes",
                    args_bytes()
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(cache);
}

/// Every pick kernel's one parameter has the size of the host's `PickRows`.
#[test]
#[ignore = "needs libnvrtc.so.13 on LD_LIBRARY_PATH; scripts/test.sh installs it and runs this"]
fn the_pick_kernels_take_the_hosts_argument_layout() {
    use lily_cuda::compile::{compile, model_defines};
    use lily_cuda::pick::pick_args_bytes;
    let cache = std::env::temp_dir().join(format!("lily-nvrtc-pick-{}", std::process::id()));
    // SAFETY: set before any thread of this test binary reads the environment.
    unsafe { std::env::set_var("LILY_KERNEL_CACHE", &cache) };
    let file = KERNEL_FILES.iter().find(|f| f.name == "pick").unwrap();
    let config = synthetic_config("tiny").unwrap();
    let ptx = compile(file, &model_defines(&config, KvPrecision::Bf16), "sm_80").unwrap();
    let text = ptx.to_src();
    for entry in file.entries {
        let param = format!(".param .align 8 .b8 {entry}_param_0[{}]", pick_args_bytes());
        assert!(
            text.contains(&param),
            "{entry}: no parameter of {} bytes",
            pick_args_bytes()
        );
    }
    let _ = std::fs::remove_dir_all(cache);
}

/// With stamps (`LILY_STAMPS=1`, stamps.rs) every file compiles, for the GPU that runs them and
/// the oldest one, and each module holds the pointer the host points at the stamp buffer: a
/// module without it would fail the backend at start.
#[test]
#[ignore = "needs libnvrtc.so.13 on LD_LIBRARY_PATH; scripts/test.sh installs it and runs this"]
fn the_stamped_kernels_compile_and_each_module_holds_the_stamp_pointer() {
    let cache = std::env::temp_dir().join(format!("lily-nvrtc-stamps-{}", std::process::id()));
    // SAFETY: set before any thread of this test binary reads the environment.
    unsafe { std::env::set_var("LILY_KERNEL_CACHE", &cache) };
    let config = synthetic_config("qwen3.6-35b-a3b").unwrap();
    for arch in ["sm_80", "sm_90"] {
        let compiled = compile_all(&config, KvPrecision::Bf16, arch, true)
            .unwrap_or_else(|e| panic!("stamped, for {arch}: {e:#}"));
        for (file, _, ptx) in &compiled {
            let text = ptx.to_src();
            assert!(
                text.contains(".global .align 8 .u64 lily_stamps"),
                "{arch}/{}: no lily_stamps",
                file.name
            );
            // On sm_90 the waits stamp: the timer is read in every file that waits.
            if arch == "sm_90" && file.source.contains("pdl_wait") {
                assert!(
                    text.contains("%globaltimer"),
                    "{arch}/{}: no stamps",
                    file.name
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(cache);
}
