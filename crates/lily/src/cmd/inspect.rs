use anyhow::Result;
use lily_core::checkpoint::Checkpoint;
use lily_core::config::ModelConfig;
use lily_core::model_ref::ModelRef;

#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint directory or synthetic:NAME.
    #[arg(long)]
    model: String,
    /// Context length for the per-sequence memory figures.
    #[arg(long, default_value_t = 32_768)]
    max_seq: usize,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<()> {
    let model = ModelRef::parse(&args.model)?;
    // Only the config and (for a directory) the file headers are read: nothing is allocated.
    let config = model.config()?;
    let disk = match &model {
        ModelRef::Dir(dir) => Some(Checkpoint::open(dir)?.bytes_on_disk()),
        ModelRef::Synthetic(_) => None,
    };
    let report = Report::new(&config, args.max_seq, disk);
    if args.json {
        println!("{}", report.json(&model.display_name(), &config));
    } else {
        print!("{}", report.text(&model.display_name(), &config));
    }
    Ok(())
}

struct Report {
    max_seq: usize,
    disk: Option<u64>,
    params: lily_core::plan::ParamCount,
    bytes: lily_core::plan::WeightBytes,
    kv_bf16: u64,
    kv_f32: u64,
    state: u64,
}

impl Report {
    fn new(c: &ModelConfig, max_seq: usize, disk: Option<u64>) -> Self {
        Report {
            max_seq,
            disk,
            params: c.param_count(),
            bytes: c.weight_bytes(),
            kv_bf16: c.kv_bytes_per_token(2),
            kv_f32: c.kv_bytes_per_token(4),
            state: c.recurrent_state_bytes() + c.conv_state_bytes(4),
        }
    }

    fn text(&self, name: &str, c: &ModelConfig) -> String {
        let gb = |b: u64| format!("{:.2} GB", b as f64 / 1e9);
        let mut s = String::new();
        s += &format!("model            {name}\n");
        s += &format!(
            "layers           {} ({} Gated DeltaNet, {} attention), hidden {}, vocab {}\n",
            c.num_layers(),
            c.num_gdn_layers(),
            c.num_attention_layers(),
            c.hidden_size,
            c.vocab_size
        );
        s += &format!(
            "attention        {} heads, {} KV heads, head dim {}, rotary dims {}, theta {}\n",
            c.num_attention_heads, c.num_kv_heads, c.head_dim, c.rotary_dim, c.rope_theta
        );
        s += &format!(
            "gated deltanet   {} key heads x {}, {} value heads x {}, conv {}\n",
            c.linear_num_key_heads,
            c.linear_key_head_dim,
            c.linear_num_value_heads,
            c.linear_value_head_dim,
            c.conv_kernel
        );
        s += &format!(
            "moe              {} experts, top {}, intermediate {}, shared {}\n",
            c.num_experts, c.experts_per_token, c.moe_intermediate_size, c.shared_intermediate_size
        );
        s += &format!(
            "parameters       {:.2} B total, {:.2} B active per token, {:.2} B in routed experts\n",
            self.params.total as f64 / 1e9,
            self.params.active as f64 / 1e9,
            self.params.routed_experts as f64 / 1e9
        );
        if let Some(d) = self.disk {
            s += &format!("on disk          {}\n", gb(d));
        }
        s += &format!(
            "weights          {} f32, {} bf16, {} 4-bit ({} read per token)\n",
            gb(self.bytes.f32),
            gb(self.bytes.bf16),
            gb(self.bytes.q4),
            gb(self.bytes.q4_active)
        );
        s += &format!(
            "per sequence     KV {} B/token (bf16), recurrent + conv state {:.1} MiB\n",
            self.kv_bf16,
            self.state as f64 / (1 << 20) as f64
        );
        s += &format!(
            "at {} tokens  CPU (f32): {}   GPU (4-bit, bf16 KV): {}\n",
            self.max_seq,
            gb(self.bytes.f32 + self.kv_f32 * self.max_seq as u64 + self.state),
            gb(self.bytes.q4 + self.kv_bf16 * self.max_seq as u64 + self.state)
        );
        s
    }

    fn json(&self, name: &str, c: &ModelConfig) -> serde_json::Value {
        serde_json::json!({
            "model": name,
            "layers": c.num_layers(),
            "gdn_layers": c.num_gdn_layers(),
            "attention_layers": c.num_attention_layers(),
            "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size,
            "num_experts": c.num_experts,
            "experts_per_token": c.experts_per_token,
            "parameters": self.params.total,
            "active_parameters": self.params.active,
            "bytes_on_disk": self.disk,
            "weight_bytes": {"f32": self.bytes.f32, "bf16": self.bytes.bf16, "q4": self.bytes.q4, "q4_per_token": self.bytes.q4_active},
            "kv_bytes_per_token": {"bf16": self.kv_bf16, "f32": self.kv_f32},
            "state_bytes": self.state,
            "max_seq": self.max_seq,
        })
    }
}
