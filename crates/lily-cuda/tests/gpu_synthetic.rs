//! Synthetic weights made on the GPU against the host generator's bytes. Needs a CUDA GPU: ignored
//! by a plain `cargo test` and run on the H200 with `--include-ignored` (tools/gpu-check.sh).
//!
//! Equality is exact: every byte of every code word, scale, bias and f32 tensor, and the logits of
//! a backend built on the generated weights to the bit.

mod support;

use anyhow::Result;
use cudarc::driver::CudaSlice;
use lily_core::backend::Backend;
use lily_core::config::ModelConfig;
use lily_core::model_ref::SYNTHETIC_SEED;
use lily_core::quant::QuantMatrix;
use lily_core::synthetic::{SyntheticSource, synthetic_config};
use lily_core::weights::ModelWeights;
use lily_cuda::gpu::Gpu;
use lily_cuda::mat::DeviceMat;
use lily_cuda::synthetic::{SyntheticWeights, generate};
use lily_cuda::weights::{DeviceWeights, HostWeights, WeightSource};
use lily_cuda::{CudaBackend, DEFAULT_PREFILL_CHUNK, KvPrecision};
use support::{NEEDS_GPU, options};

/// Where two byte strings first differ, if they do.
fn first_difference(a: &[u8], b: &[u8]) -> Option<String> {
    if a.len() != b.len() {
        return Some(format!("{} bytes against {}", a.len(), b.len()));
    }
    let i = a.iter().zip(b).position(|(x, y)| x != y)?;
    Some(format!(
        "byte {i} of {}: {:#04x} against {:#04x}",
        a.len(),
        a[i],
        b[i]
    ))
}

/// A source that makes every tensor both ways (generated on the GPU, and the host generator's
/// copy uploaded), compares the device bytes, and hands on the generated one: driven by
/// `DeviceWeights::build`, it checks every tensor the backend holds.
struct Compare<'a> {
    generated: SyntheticWeights,
    host: HostWeights<'a>,
    checked: usize,
    failures: Vec<String>,
}

impl Compare<'_> {
    fn check(&mut self, name: &str, ours: &[Vec<u8>], host: &[Vec<u8>]) {
        self.checked += 1;
        for ((part, a), b) in ["codes", "scales", "biases"].iter().zip(ours).zip(host) {
            if let Some(d) = first_difference(a, b) {
                self.failures.push(format!("{name} {part}: {d}"));
            }
        }
    }

    fn check_floats(&mut self, gpu: &Gpu, name: &str, ours: &CudaSlice<f32>, host: CudaSlice<f32>) {
        let bytes = |s: &CudaSlice<f32>| -> Vec<u8> {
            let values = gpu.download(s).unwrap();
            values.iter().flat_map(|v| v.to_le_bytes()).collect()
        };
        self.check(name, &[bytes(ours)], &[bytes(&host)]);
    }
}

impl WeightSource for Compare<'_> {
    fn device_bytes(&self, c: &ModelConfig) -> usize {
        self.generated.device_bytes(c)
    }

    fn mat(
        &mut self,
        gpu: &Gpu,
        module: &str,
        count: usize,
        rows: usize,
        cols: usize,
    ) -> Result<DeviceMat> {
        let ours = self.generated.mat(gpu, module, count, rows, cols)?;
        let host = self.host.mat(gpu, module, count, rows, cols)?;
        let format = |m: &DeviceMat| (m.bits, m.rows, m.cols, m.group);
        if format(&ours) != format(&host) {
            let (a, b) = (format(&ours), format(&host));
            self.failures.push(format!(
                "{module}: (bits, rows, cols, group) {a:?} against {b:?}"
            ));
        }
        self.check(module, &ours.download(gpu)?, &host.download(gpu)?);
        Ok(ours)
    }

    fn norm(&mut self, gpu: &Gpu, name: &str, len: usize) -> Result<CudaSlice<f32>> {
        let ours = self.generated.norm(gpu, name, len)?;
        let host = self.host.norm(gpu, name, len)?;
        self.check_floats(gpu, name, &ours, host);
        Ok(ours)
    }

    fn floats(&mut self, gpu: &Gpu, name: &str, shape: &[usize]) -> Result<CudaSlice<f32>> {
        let ours = self.generated.floats(gpu, name, shape)?;
        let host = self.host.floats(gpu, name, shape)?;
        self.check_floats(gpu, name, &ours, host);
        Ok(ours)
    }
}

/// The full-size model's widths cut to one Gated DeltaNet and one attention layer.
fn full_width_two_layers() -> ModelConfig {
    let mut root: serde_json::Value =
        serde_json::from_str(lily_core::config::QWEN36_35B_A3B_CONFIG).unwrap();
    let t = root["text_config"].as_object_mut().unwrap();
    t.insert("num_hidden_layers".into(), 2.into());
    t.insert(
        "layer_types".into(),
        serde_json::json!(["linear_attention", "full_attention"]),
    );
    ModelConfig::from_json(&root.to_string()).unwrap()
}

/// Every tensor of `DeviceWeights` for the tiny model, a tiny model too narrow to quantise its
/// hidden-size inputs (dense f32 linears from the host, a tied embedding) and the full-width
/// two-layer cut, whose shared-expert gate is a one-row matrix (ragged against every block).
#[test]
#[ignore = "needs a CUDA GPU"]
fn device_generated_weights_equal_the_host_bytes() {
    let mut narrow = synthetic_config("tiny").unwrap();
    narrow.hidden_size = 96;
    narrow.tie_word_embeddings = true;
    let configs = [
        ("tiny", synthetic_config("tiny").unwrap()),
        ("tiny, hidden 96, tied", narrow),
        ("full width, 2 layers", full_width_two_layers()),
    ];
    for (label, config) in configs {
        let host =
            ModelWeights::load(&config, Box::new(SyntheticSource::new(SYNTHETIC_SEED))).unwrap();
        let gpu = Gpu::new(&config, KvPrecision::Bf16).expect(NEEDS_GPU);
        let mut compare = Compare {
            generated: SyntheticWeights::new(SYNTHETIC_SEED),
            host: HostWeights(&host),
            checked: 0,
            failures: Vec::new(),
        };
        DeviceWeights::build(&gpu, &config, &mut compare).unwrap();
        eprintln!(
            "{label}: {} tensors compared, {} differ",
            compare.checked,
            compare.failures.len()
        );
        assert!(
            compare.failures.is_empty(),
            "{label}: {:#?}",
            compare.failures
        );
    }
}

/// The bytes of a host matrix as the device stores them.
fn host_bytes(parts: &[QuantMatrix]) -> [Vec<u8>; 3] {
    let halves = |f: fn(&QuantMatrix) -> &[half::bf16]| -> Vec<u8> {
        let values = parts.iter().flat_map(f);
        values.flat_map(|v| v.to_bits().to_le_bytes()).collect()
    };
    let codes = parts.iter().flat_map(|q| q.codes());
    [
        codes.flat_map(|v| v.to_le_bytes()).collect(),
        halves(|q| q.scales()),
        halves(|q| q.biases()),
    ]
}

/// The generator alone at shapes no block or grid size divides: single rows, prime row counts, a
/// stack whose matrices start mid-stream, and one large enough that the kernel's grid strides.
#[test]
#[ignore = "needs a CUDA GPU"]
fn device_generator_matches_the_host_at_ragged_shapes() {
    let config = synthetic_config("tiny").unwrap();
    let gpu = Gpu::new(&config, KvPrecision::Bf16).expect(NEEDS_GPU);
    let src = SyntheticSource::new(5);
    // (module, stacked matrices, rows each, cols): 4-bit experts and 8-bit routers.
    let cases = [
        ("layers.0.mlp.switch_mlp.down_proj", 1, 1, 64),
        ("layers.0.mlp.switch_mlp.down_proj", 3, 7, 192),
        ("layers.0.mlp.switch_mlp.up_proj", 1, 4099, 192),
        ("layers.1.mlp.gate", 1, 3, 128),
        ("layers.1.mlp.shared_expert_gate", 5, 1, 320),
        // 4.8 M words: more than the kernel's 8,192 blocks of 256 threads cover in one pass.
        ("layers.1.mlp.gate", 1, 100_003, 192),
    ];
    for (module, count, rows, cols) in cases {
        let stream = src.quant_stream(module, cols).unwrap();
        let parts: Vec<QuantMatrix> = (0..count)
            .map(|i| stream.matrix(i, rows, cols).unwrap())
            .collect();
        let ours = generate(&gpu, &stream, count * rows, cols)
            .unwrap()
            .download(&gpu)
            .unwrap();
        for ((part, a), b) in ["codes", "scales", "biases"]
            .iter()
            .zip(&ours)
            .zip(&host_bytes(&parts))
        {
            let d = first_difference(a, b);
            assert!(
                d.is_none(),
                "{module}, {count}x{rows}x{cols} {}-bit, {part}: {}",
                stream.bits,
                d.unwrap_or_default()
            );
        }
        eprintln!(
            "{module}: {count}x{rows}x{cols} at {} bits equal",
            stream.bits
        );
    }
}

/// A backend on GPU-generated weights computes what one on uploaded host weights does, to the
/// bit: the same bytes in the same layout.
#[test]
#[ignore = "needs a CUDA GPU"]
fn backend_on_device_generated_weights_equals_the_uploaded_one() {
    let config = synthetic_config("tiny").unwrap();
    let host = ModelWeights::load(&config, Box::new(SyntheticSource::new(SYNTHETIC_SEED))).unwrap();
    let kv = KvPrecision::F32;
    let uploaded = CudaBackend::with_kv(config.clone(), &host, kv).expect(NEEDS_GPU);
    let mut source = SyntheticWeights::new(SYNTHETIC_SEED);
    let generated = CudaBackend::from_source(
        config.clone(),
        &mut source,
        &options(kv, DEFAULT_PREFILL_CHUNK),
    )
    .unwrap();
    let tokens = [9419u32, 11, 1814, 13, 576, 374];
    let run = |b: &CudaBackend| -> Vec<u32> {
        let mut state = b.new_state(tokens.len()).unwrap();
        let steps = tokens.iter().map(|&t| b.decode(&mut state, t).unwrap());
        steps.flatten().map(f32::to_bits).collect()
    };
    let (ours, theirs) = (run(&generated), run(&uploaded));
    let differ = ours.iter().zip(&theirs).filter(|(a, b)| a != b).count();
    eprintln!(
        "{} decode steps, {} logits: {differ} differ",
        tokens.len(),
        ours.len()
    );
    assert_eq!(differ, 0);
    assert_eq!(ours.len(), tokens.len() * config.vocab_size);
}
