//! Every kernel's arguments as a struct (kernels/*.cu): one field per parameter, in the
//! signature's order, so that a launch names what it passes instead of listing it by position.
//! `tests/nvrtc.rs` holds each struct's parameter kinds to the compiled entry points' (PTX) and
//! checks that every entry point has a struct ([`entry_kinds`]); a test below holds the fields'
//! names to the kernels' parameter names in kernels/*.cu.

use crate::gpu::{KArg, RowInts, RowPtrs};
use crate::mat::MatArg;

/// What a kernel parameter is, as PTX declares it: a 64-bit word (pointers and u64), a 32-bit
/// integer, an f32, or a struct by value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgKind {
    U64,
    I32,
    F32,
    Mat,
    Rows,
    Ints,
}

/// A field type of a kernel's arguments.
pub trait ArgType: Copy {
    fn kinds(out: &mut Vec<ArgKind>);
    fn push(self, out: &mut Vec<KArg>);
    /// The kernel parameter names a field named `field` stands for: itself, one parameter.
    fn names(field: &str, out: &mut Vec<String>) {
        out.push(field.to_string());
    }
}

macro_rules! arg_type {
    ($ty:ty, $kind:ident, $karg:ident) => {
        impl ArgType for $ty {
            fn kinds(out: &mut Vec<ArgKind>) {
                out.push(ArgKind::$kind);
            }
            fn push(self, out: &mut Vec<KArg>) {
                out.push(KArg::$karg(self));
            }
        }
    };
}
arg_type!(u64, U64, Ptr);
arg_type!(i32, I32, I32);
arg_type!(f32, F32, F32);
arg_type!(MatArg, Mat, Mat);
arg_type!(RowPtrs, Rows, Rows);
arg_type!(RowInts, Ints, Ints);

/// The four matrices of a GEMV launch (`Mat m0, Mat m1, Mat m2, Mat m3`), unused ones empty.
impl ArgType for [MatArg; 4] {
    fn kinds(out: &mut Vec<ArgKind>) {
        out.extend([ArgKind::Mat; 4]);
    }
    fn push(self, out: &mut Vec<KArg>) {
        out.extend(self.map(KArg::Mat));
    }
    fn names(_: &str, out: &mut Vec<String>) {
        out.extend((0..4).map(|i| format!("m{i}")));
    }
}

/// What every dense GEMM entry takes after its weight or weights (`gemm_b*`, `gemm_wgmma_b4` and
/// its _x16 stack): X, its rows, the output and where in it, and the K columns a split takes.
#[derive(Clone, Copy)]
pub struct DenseOut {
    pub x: u64,
    pub m: i32,
    pub y: u64,
    pub ldy: i32,
    pub col0: i32,
    pub k_split: i32,
}

impl ArgType for DenseOut {
    fn kinds(out: &mut Vec<ArgKind>) {
        out.extend([
            ArgKind::U64,
            ArgKind::I32,
            ArgKind::U64,
            ArgKind::I32,
            ArgKind::I32,
            ArgKind::I32,
        ]);
    }
    fn push(self, out: &mut Vec<KArg>) {
        out.extend([
            KArg::Ptr(self.x),
            KArg::I32(self.m),
            KArg::Ptr(self.y),
            KArg::I32(self.ldy),
            KArg::I32(self.col0),
            KArg::I32(self.k_split),
        ]);
    }
    fn names(_: &str, out: &mut Vec<String>) {
        out.extend(["x", "m", "y", "ldy", "col0", "k_split"].map(String::from));
    }
}

/// A kernel's arguments.
pub trait KernelArgs {
    /// The parameter kinds in order.
    fn kinds() -> Vec<ArgKind>;
    /// The parameter names in order (the fields' names; `mats` stands for `m0` to `m3`).
    fn names() -> Vec<String>;
    /// The arguments in order.
    fn args(&self) -> Vec<KArg>;
}

macro_rules! kernel_args {
    ($($(#[$meta:meta])* $name:ident { $($field:ident: $ty:ty),* $(,)? })*) => {
        $(
            $(#[$meta])*
            #[derive(Clone, Copy)]
            pub struct $name {
                $(pub $field: $ty),*
            }
            impl KernelArgs for $name {
                fn kinds() -> Vec<ArgKind> {
                    let mut out = Vec::new();
                    $(<$ty as ArgType>::kinds(&mut out);)*
                    out
                }
                fn names() -> Vec<String> {
                    let mut out = Vec::new();
                    $(<$ty as ArgType>::names(stringify!($field), &mut out);)*
                    out
                }
                fn args(&self) -> Vec<KArg> {
                    let mut out = Vec::new();
                    $(self.$field.push(&mut out);)*
                    out
                }
            }
        )*
    };
}

kernel_args! {
    // ---- The decode step (step.rs, gemv.rs) ----
    /// `embed_rows_b*`: each row's token from its slot.
    EmbedRows { table: MatArg, tokens: RowPtrs, out: u64 }
    /// `gemv_norm_b*`.
    GemvNorm { mats: [MatArg; 4], hidden: u64, norm_w: u64, eps: f32, y: u64 }
    /// `gemv_add_b*` (and `gemv_b*`).
    GemvAdd { mats: [MatArg; 4], x: u64, y: u64 }
    /// `gemv_rows_norm_b*_x*` and `gemv_mma_norm_b4_t*`.
    GemvRowsNorm { mats: [MatArg; 4], nx: i32, hidden: u64, norm_w: u64, eps: f32, y: u64 }
    /// `gemv_rows_add_b*_x*` and `gemv_mma_add_b4_t*`.
    GemvRowsAdd { mats: [MatArg; 4], nx: i32, x: u64, y: u64 }
    /// `gemv_q4_norm_t*`.
    GemvQ4Norm {
        mats: [MatArg; 4], nx: i32, hidden: u64, norm_w: u64, eps: f32, y: u64, split: i32,
    }
    /// `gemv_q4_add_t*`.
    GemvQ4Add { mats: [MatArg; 4], nx: i32, x: u64, y: u64, split: i32 }
    /// `gemv_q4_gdn_t*`.
    GemvQ4Gdn {
        mats: [MatArg; 4], nx: i32, hidden: u64, norm_w: u64, eps: f32, proj: u64, conv_w: u64,
        window: RowPtrs, conv: u64, split: i32,
    }
    /// `gemv_q4_gated_t*`.
    GemvQ4Gated {
        m: MatArg, nx: i32, o: u64, proj: u64, norm_w: u64, eps: f32, y: u64, split: i32,
    }
    GdnStep { conv: u64, proj: u64, a_log: u64, dt_bias: u64, state: RowPtrs, out: u64 }
    GdnDecodeStep {
        proj: u64, conv_w: u64, windows: RowPtrs, a_log: u64, dt_bias: u64, states: RowPtrs,
        norm_w: u64, arrivals: u64, y: u64, eps: f32,
    }
    AttnPrep {
        qkv: u64, q_norm: u64, k_norm: u64, pos: RowPtrs, q_out: u64, k_cache: RowPtrs,
        v_cache: RowPtrs, eps: f32,
    }
    AttnSplit {
        q: u64, k_cache: RowPtrs, v_cache: RowPtrs, pos: RowPtrs, nsplit: RowInts, part_ml: u64,
        part_acc: u64,
    }
    AttnCombine { part_ml: u64, part_acc: u64, pos: RowPtrs, nsplit: RowInts, qkv: u64, out: u64 }
    /// `moe_route_gate_up_b*_r*`.
    MoeRouteGateUp {
        router: MatArg, shared_logit: MatArg, gate: MatArg, up: MatArg, shared_gate: MatArg,
        shared_up: MatArg, hidden: u64, norm_w: u64, eps: f32, logits: u64, ids: u64,
        weights: u64, sync: u64, act: u64,
    }
    /// `moe_route_imma_t*`.
    MoeRouteImma {
        router: MatArg, sh_gate: MatArg, nx: i32, hidden: u64, norm_w: u64, eps: f32, logits: u64,
        ids: u64, weights: u64, done: u64, split: i32,
    }
    /// `moe_gate_up_imma`.
    MoeGateUpImma {
        gate: MatArg, up: MatArg, sh_gate: MatArg, sh_up: MatArg, inter: i32, ids: u64,
        weights: u64, logits: u64, hidden: u64, norm_w: u64, eps: f32, act: u64, split: i32,
    }
    /// `moe_down_imma`.
    MoeDownImma {
        down: MatArg, sh_down: MatArg, inter: i32, hidden: i32, ids: u64, act: u64, residual: u64,
        split: i32,
    }
    /// `moe_down_b*`.
    MoeDown {
        down: MatArg, sh_down: MatArg, ids: u64, weights: u64, logits: u64, act: u64,
        residual: u64, sync: u64,
    }
    ArgmaxPartial { logits: u64, stride: i32, choices: RowInts, part_v: u64, part_i: u64 }
    ArgmaxFinal {
        part_v: u64, part_i: u64, choices: RowInts, token: RowPtrs, pos: RowPtrs, chosen: u64,
    }

    // ---- Prefill (prefill.rs and its stages) ----
    /// `embed_b*`: the rows of a chunk's tokens.
    Embed { table: MatArg, tokens: u64, out: u64 }
    AddRmsNorm {
        hidden: u64, delta: u64, parts: i32, part_stride: i32, scale: u64, out: u64, out16: u64,
        n: i32, eps: f32,
    }
    AttnPrepRows {
        qkv: u64, ld: i32, q_norm: u64, k_norm: u64, pos0: i32, q_out: u64, k_cache: u64,
        v_cache: u64, eps: f32,
    }
    /// `attn_prefill_r*_s*`.
    AttnPrefill {
        q: u64, k_cache: u64, v_cache: u64, pos0: i32, t: i32, qkv: u64, ld: i32, out: u64,
        out16: u64,
    }
    GdnConvRows {
        proj: u64, ld: i32, t: i32, conv_w: u64, window: u64, out: u64, fork_window: u64,
        fork_at: i32,
    }
    GdnScanPrep {
        conv: u64, proj: u64, ld: i32, t: i32, a_log: u64, dt_bias: u64, prep: u64,
    }
    GdnScan { conv: u64, prep: u64, t: i32, state: u64, out: u64 }
    GdnChunkPrep { prep: u64, t: i32, scratch: u64 }
    GdnChunkScan { conv: u64, prep: u64, scratch: u64, t: i32, state: u64, out: u64 }
    GdnGatedNormRows { o: u64, proj: u64, ld: i32, t: i32, w: u64, y: u64, y16: u64, eps: f32 }
    /// `gemm_b*` and `gemm_wgmma_b4`.
    Gemm { w: MatArg, out: DenseOut }
    /// `gemm_wgmma_b4_x16`: a stack of up to four weights, unused ones empty.
    GemmStack { mats: [MatArg; 4], out: DenseOut }
    GemmReduce { part: u64, splits: i32, m: i32, n: i32, y: u64, ldy: i32, col0: i32 }
    /// `gemm_grouped*_b*` and `gemm_wgmma_grouped64_b4`.
    GemmGrouped {
        w: MatArg, n: i32, x: u64, gather: u64, tiles: u64, num_tiles: u64, y: u64,
    }
    GemmGateUp {
        gate: MatArg, up: MatArg, n: i32, x: u64, gather: u64, tiles: u64, num_tiles: u64, act: u64,
        act16: u64,
    }
    MoeTopkRows { logits: u64, t: i32, ids: u64, weights: u64 }
    MoeSortCount { ids: u64, pairs: i32, counts: u64 }
    MoeSortOffsets { counts: u64, blocks: i32, tile_rows: i32, tiles: u64, num_tiles: u64 }
    MoeSortScatter { ids: u64, pairs: i32, offsets: u64, gather: u64, slot_of: u64 }
    MoeDenseTiles { t: i32, tile_rows: i32, tiles: u64, num_tiles: u64 }
    MoeSwiglu { gate: u64, up: u64, n: i32, act: u64, act16: u64 }
    MoeCombine {
        down: u64, slot_of: u64, weights: u64, logits: u64, shared: u64, shared_parts: i32,
        shared_stride: i32, h: i32, out: u64,
    }

    // ---- Synthetic weights made on the device (synthetic.rs) ----
    SyntheticQuant {
        w: u64, scales: u64, biases: u64, words: i32, groups: i32, code_key: u64, scale_key: u64,
        c: f32, bits: i32,
    }
}

/// Every entry point of [`crate::compile::KERNEL_FILES`] that takes its arguments one by one,
/// with its parameter kinds. The pick kernels take one `PickArgs` struct (pick.rs) and are not
/// listed.
pub fn entry_kinds() -> Vec<(String, Vec<ArgKind>)> {
    entries().into_iter().map(|e| (e.name, e.kinds)).collect()
}

/// An entry point and its argument struct's parameters.
pub struct Entry {
    pub name: String,
    pub kinds: Vec<ArgKind>,
    pub names: Vec<String>,
}

/// The entry points of [`entry_kinds`] with their structs' parameter names too.
pub fn entries() -> Vec<Entry> {
    fn each<A: KernelArgs>(names: impl IntoIterator<Item = String>) -> Vec<Entry> {
        names
            .into_iter()
            .map(|name| Entry {
                name,
                kinds: A::kinds(),
                names: A::names(),
            })
            .collect()
    }
    let bits = |prefix: &str| [4, 8, 32].map(|b| format!("{prefix}_b{b}"));
    let rows = |form: &str| {
        [4, 8, 32]
            .into_iter()
            .flat_map(move |b| [2, 4, 8].map(|x| format!("gemv_rows_{form}_b{b}_x{x}")))
            .collect::<Vec<_>>()
    };
    let one = |name: &str| [name.to_string()];
    let mma = |form: &str| [1, 3].map(|t| format!("gemv_mma_{form}_b4_t{t}"));
    let q4 = |form: &str| [1, 2, 4].map(|t| format!("gemv_q4_{form}_t{t}"));
    let mut all = Vec::new();
    all.extend(each::<EmbedRows>(bits("embed_rows")));
    all.extend(each::<Embed>(bits("embed")));
    all.extend(each::<GemvNorm>(bits("gemv_norm")));
    all.extend(each::<GemvAdd>(
        bits("gemv_add").into_iter().chain(bits("gemv")),
    ));
    all.extend(each::<GemvRowsNorm>(
        rows("norm").into_iter().chain(mma("norm")),
    ));
    all.extend(each::<GemvRowsAdd>(
        rows("add").into_iter().chain(mma("add")),
    ));
    all.extend(each::<GemvQ4Norm>(q4("norm")));
    all.extend(each::<GemvQ4Add>(q4("add")));
    all.extend(each::<GemvQ4Gated>(q4("gated")));
    all.extend(each::<GemvQ4Gdn>(q4("gdn")));
    all.extend(each::<GdnStep>(one("gdn_step")));
    all.extend(each::<GdnDecodeStep>(one("gdn_decode_step")));
    all.extend(each::<AttnPrep>(one("attn_prep")));
    all.extend(each::<AttnSplit>(one("attn_split")));
    all.extend(each::<AttnCombine>(one("attn_combine")));
    all.extend(each::<MoeRouteGateUp>(
        bits("moe_route_gate_up")
            .into_iter()
            .flat_map(|b| [4, 8, 32].map(|r| format!("{b}_r{r}"))),
    ));
    all.extend(each::<MoeDown>(
        bits("moe_down")
            .into_iter()
            .chain(["moe_down_b4_r1", "moe_down_b8_r1"].map(String::from)),
    ));
    all.extend(each::<MoeRouteImma>(
        [1, 2, 4].map(|t| format!("moe_route_imma_t{t}")),
    ));
    all.extend(each::<MoeGateUpImma>(one("moe_gate_up_imma")));
    all.extend(each::<MoeDownImma>(one("moe_down_imma")));
    all.extend(each::<ArgmaxPartial>(one("argmax_partial")));
    all.extend(each::<ArgmaxFinal>(one("argmax_final")));
    all.extend(each::<AddRmsNorm>(one("add_rms_norm")));
    all.extend(each::<AttnPrepRows>(one("attn_prep_rows")));
    all.extend(each::<AttnPrefill>(
        [
            "attn_prefill_r128_s4",
            "attn_prefill_r128_s2",
            "attn_prefill_r64_s2",
        ]
        .map(String::from),
    ));
    all.extend(each::<GdnConvRows>(one("gdn_conv_rows")));
    all.extend(each::<GdnScanPrep>(one("gdn_scan_prep")));
    all.extend(each::<GdnScan>(one("gdn_scan")));
    all.extend(each::<GdnChunkPrep>(one("gdn_chunk_prep")));
    all.extend(each::<GdnChunkScan>(one("gdn_chunk_scan")));
    all.extend(each::<GdnGatedNormRows>(one("gdn_gated_norm_rows")));
    all.extend(each::<Gemm>(
        bits("gemm")
            .into_iter()
            .chain(["gemm_wgmma_b4"].map(String::from)),
    ));
    all.extend(each::<GemmStack>(one("gemm_wgmma_b4_x16")));
    all.extend(each::<GemmReduce>(one("gemm_reduce")));
    all.extend(each::<GemmGrouped>(
        bits("gemm_grouped16")
            .into_iter()
            .chain(bits("gemm_grouped64"))
            .chain(["gemm_wgmma_grouped64_b4", "gemm_wgmma_grouped64_b4_x16"].map(String::from)),
    ));
    all.extend(each::<GemmGateUp>(one("gemm_wgmma_gate_up64_b4_x16")));
    all.extend(each::<MoeTopkRows>(one("moe_topk_rows")));
    all.extend(each::<MoeSortCount>(one("moe_sort_count")));
    all.extend(each::<MoeSortOffsets>(one("moe_sort_offsets")));
    all.extend(each::<MoeSortScatter>(one("moe_sort_scatter")));
    all.extend(each::<MoeDenseTiles>(one("moe_dense_tiles")));
    all.extend(each::<MoeSwiglu>(one("moe_swiglu")));
    all.extend(each::<MoeCombine>(one("moe_combine")));
    all.extend(each::<SyntheticQuant>(one("synthetic_quant")));
    all
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::KERNEL_FILES;

    /// The entry points a kernel file declares: each name's pattern (a macro's `##PARAM` pieces
    /// stand for what the macro is given) and its parameter names.
    fn signatures(source: &str) -> Vec<(String, Vec<String>)> {
        let text = source.replace("\\\n", "\n");
        let mut out = Vec::new();
        for piece in text.split("__global__").skip(1) {
            let mut rest = piece
                .trim_start()
                .strip_prefix("void")
                .expect("void")
                .trim_start();
            if let Some(bounds) = rest.strip_prefix("__launch_bounds__") {
                rest = bounds[bounds.find(')').expect("bounds") + 1..].trim_start();
            }
            let (open, close) = (rest.find('(').expect("("), rest.find(')').expect(")"));
            let params = rest[open + 1..close]
                .split(',')
                .filter(|p| !p.trim().is_empty())
                .map(|p| {
                    let last = p.trim().rsplit(|c: char| c.is_whitespace() || c == '*');
                    last.into_iter().next().expect("a name").to_string()
                })
                .collect();
            out.push((rest[..open].trim().to_string(), params));
        }
        out
    }

    /// Whether `entry` is what a macro makes of `pattern` (`gemv_rows_norm_b##BITS##_x##NX` ⊃
    /// `gemv_rows_norm_b4_x8`): literal pieces match themselves, upper-case pieces any letters
    /// or digits.
    fn instance(pieces: &[&str], entry: &str) -> bool {
        let Some((first, rest)) = pieces.split_first() else {
            return entry.is_empty();
        };
        let param = first.chars().all(|c| c.is_ascii_uppercase() || c == '_');
        if !param {
            return entry
                .strip_prefix(first)
                .is_some_and(|tail| instance(rest, tail));
        }
        (1..=entry.len())
            .take_while(|&n| entry[..n].chars().all(|c| c.is_ascii_alphanumeric()))
            .any(|n| instance(rest, &entry[n..]))
    }

    /// Each struct's fields are named as its kernels' parameters, in order (the NVRTC test checks
    /// their kinds; two fields of one kind swapped show only here).
    #[test]
    fn every_struct_names_its_kernels_parameters_in_order() {
        let declared: Vec<(String, Vec<String>)> = KERNEL_FILES
            .iter()
            .flat_map(|f| signatures(f.source))
            .collect();
        for e in entries() {
            let matching: Vec<&Vec<String>> = declared
                .iter()
                .filter(|(pattern, _)| instance(&pattern.split("##").collect::<Vec<_>>(), &e.name))
                .map(|(_, params)| params)
                .collect();
            assert_eq!(matching.len(), 1, "{}: one declaration", e.name);
            assert_eq!(matching[0], &e.names, "{}", e.name);
        }
    }

    #[test]
    fn a_macros_name_pattern_matches_its_instances_only() {
        let p = |s: &'static str| s.split("##").collect::<Vec<_>>();
        assert!(instance(
            &p("gemv_rows_norm_b##BITS##_x##NX"),
            "gemv_rows_norm_b32_x8"
        ));
        assert!(instance(
            &p("attn_prefill_r##ROWS##_s##SLOTS"),
            "attn_prefill_r128_s4"
        ));
        assert!(!instance(&p("gemv_b##BITS"), "gemv_norm_b4"));
        assert!(!instance(&p("gemm_b##BITS"), "gemm_wgmma_b4"));
        assert!(instance(&p("gdn_scan"), "gdn_scan"));
        assert!(!instance(&p("gdn_scan"), "gdn_scan_prep"));
    }
}
