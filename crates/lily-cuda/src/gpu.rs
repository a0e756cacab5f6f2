//! The device, its stream, the compiled kernels and the launch helper.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, bail};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
    PushKernelArg, ValidAsZeroBits,
};
use lily_core::config::ModelConfig;

use crate::compile::{KERNEL_FILES, KvPrecision, compile, kernel_defines};
use crate::gemm_wgmma::GemmPath;
use crate::kernel_args::KernelArgs;
use crate::mat::MatArg;
use crate::options::CudaOptions;

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    functions: HashMap<String, CudaFunction>,
    pub name: String,
    pub arch: String,
    pub kv: KvPrecision,
    /// Streaming multiprocessors, for launches sized to one wave ([`Gpu::resident_blocks_256`]).
    pub sms: u32,
    /// Blocks of 256 threads of each kernel one SM holds at once.
    resident_256: HashMap<String, u32>,
    /// Whether the GPU and the environment allow programmatic dependent launch (sm_90+).
    pdl: bool,
    /// Set while [`Gpu::programmatic`] runs: launches then use it.
    pdl_now: AtomicBool,
    /// Bytes of shared memory one block may opt in to.
    pub shared_optin: usize,
    /// Which tensor cores the graph decode step's 4-bit products run on.
    pub decode_kernels: crate::options::DecodeKernels,
    /// The GDN prefill route the options force, if any ([`crate::gdn_prefill::route_for`]).
    pub gdn_prefill_route: Option<crate::gdn_prefill::GdnPrefillRoute>,
    /// How prefill runs the routed experts' gate and up projections where it may choose.
    pub gate_up: crate::gemm_grouped::GateUpRoute,
    /// Which kernels run the 4-bit prefill GEMMs ([`Gpu::set_gemm_path`]).
    gemm_path: GemmPath,
    /// Partial sums of dense GEMMs split along K ([`crate::gemm::gemm`]); one launch at a time
    /// uses it, in stream order.
    pub(crate) gemm_partials: CudaSlice<f32>,
    /// Where the kernels append their wait stamps, when compiled to ([`CudaOptions::stamps`]).
    pub(crate) stamps: Option<Mutex<CudaSlice<u64>>>,
    /// The names of the kernels launched while [`Gpu::logging_launches`] runs.
    launch_log: Mutex<Option<Vec<String>>>,
}

/// Whether a CUDA driver and at least one GPU are present (without panicking when not).
pub fn gpu_available() -> bool {
    // SAFETY: only probes whether the driver library can be opened.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return false;
    }
    CudaContext::device_count().map(|n| n > 0).unwrap_or(false)
}

impl Gpu {
    /// Opens GPU 0 and compiles every kernel for the model, with the environment's options
    /// ([`CudaOptions::from_env`]) and the KV cache stored as `kv`.
    pub fn new(config: &ModelConfig, kv: KvPrecision) -> Result<Self> {
        Self::with_options(config, &CudaOptions::from_env()?.with_kv(kv))
    }

    /// Opens GPU 0 and compiles every kernel for the model as `options` say.
    pub fn with_options(config: &ModelConfig, options: &CudaOptions) -> Result<Self> {
        let kv = options.kv;
        if !gpu_available() {
            bail!("no CUDA GPU found (the CUDA driver library is missing or sees no device)");
        }
        let ctx = CudaContext::new(0).context("cannot open GPU 0")?;
        // One stream does all the work, so cudarc's cross-stream event tracking is not needed,
        // and it would add events inside captured graphs.
        // SAFETY: no buffer is ever used from a second stream.
        unsafe { ctx.disable_event_tracking() };
        // A created stream: the legacy default stream cannot be captured into a graph.
        let stream = ctx.new_stream().context("cannot create a CUDA stream")?;
        let (major, minor) = ctx.compute_capability()?;
        if major < 8 {
            bail!("GPU compute capability {major}.{minor} is below 8.0 (Ampere), which Lily needs");
        }
        let arch = format!("sm_{major}{minor}");
        let gemm_path = GemmPath::choose(&arch, options.gemm)?;
        let name = ctx.name()?;
        let sms = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as u32;
        let defines = kernel_defines(config, kv, options.stamps);
        let stamps = if options.stamps {
            let mut buffer = stream.alloc_zeros::<u64>(crate::stamps::buffer_words())?;
            let header = [0, crate::stamps::STAMP_RECORDS as u64];
            stream.memcpy_htod(&header, &mut buffer.slice_mut(..2))?;
            Some(buffer)
        } else {
            None
        };
        let mut functions = HashMap::new();
        // Every file the GPU can run; an architecture-specific one for its own target (sm_90a),
        // a file of one kind of decode kernels where the options select them.
        for (file, target) in KERNEL_FILES
            .iter()
            .filter(|f| f.decode_kernels.is_none_or(|k| k == options.decode_kernels))
            .filter_map(|f| f.target(&arch).map(|t| (f, t)))
        {
            let ptx = compile(file, &defines, &target)?;
            let module = ctx
                .load_module(ptx)
                .with_context(|| format!("loading kernels {}.cu", file.name))?;
            if let Some(buffer) = &stamps {
                // Each module has its own copy of the pointer the stamps go through.
                let at = ptr(buffer, &stream);
                let mut global = module.get_global("lily_stamps", &stream)?;
                // SAFETY: lily_stamps is one 8-byte pointer in every module (common.cuh).
                let mut pointer = unsafe { global.transmute_mut::<u64>(1) }
                    .context("lily_stamps is not a pointer")?;
                stream.memcpy_htod(&[at], &mut pointer)?;
            }
            for entry in file.entries {
                let f = module
                    .load_function(entry)
                    .with_context(|| format!("kernel {entry}"))?;
                functions.insert(entry.to_string(), f);
            }
        }
        // Kernels that take more than the default 48 KiB of dynamic shared memory must say so
        // once, before their first launch (cuFuncSetAttribute MAX_DYNAMIC_SHARED_SIZE_BYTES).
        let optin = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )? as usize;
        let wgmma = GemmPath::supported(&arch).contains(&GemmPath::Wgmma);
        let raised = crate::gemm::dynamic_shared(wgmma)
            .into_iter()
            .chain(crate::gdn_chunked::dynamic_shared(config, optin))
            .chain(crate::attention_prefill::dynamic_shared(config, optin))
            .chain(crate::gemv::dynamic_shared(optin, options.decode_kernels));
        for (entry, bytes) in raised {
            let f = functions
                .get(entry.as_str())
                .with_context(|| format!("kernel {entry} is not compiled"))?;
            // A block's static shared memory comes out of the same opt-in limit.
            let bytes = bytes.min((optin as u32).saturating_sub(f.shared_size_bytes()? as u32));
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .map_err(|e| anyhow::anyhow!("kernel {entry}: {bytes} bytes of shared memory: {e:?}"))?;
        }
        // Kernels written for other block sizes (or more dynamic shared memory) get no entry.
        let mut resident_256 = HashMap::new();
        for (entry, f) in &functions {
            if let Ok(blocks) = f.occupancy_max_active_blocks_per_multiprocessor(256, 0, None) {
                resident_256.insert(entry.clone(), blocks);
            }
        }
        let gemm_partials = stream.alloc_zeros(crate::gemm::partial_floats(sms))?;
        Ok(Gpu {
            ctx,
            stream,
            functions,
            name,
            arch,
            kv,
            sms,
            resident_256,
            pdl: major >= 9 && options.pdl,
            pdl_now: AtomicBool::new(false),
            shared_optin: optin,
            gemm_partials,
            decode_kernels: options.decode_kernels,
            gdn_prefill_route: options.gdn_prefill,
            gate_up: options.gate_up,
            gemm_path,
            stamps: stamps.map(Mutex::new),
            launch_log: Mutex::new(None),
        })
    }

    /// Runs `encode` with the names of the kernels it launches logged, and returns them too.
    pub(crate) fn logging_launches<T>(
        &self,
        encode: impl FnOnce() -> Result<T>,
    ) -> Result<(T, Vec<String>)> {
        self.set_launch_log(Some(Vec::new()))?;
        let done = encode();
        let names = self.set_launch_log(None)?.unwrap_or_default();
        Ok((done?, names))
    }

    fn set_launch_log(&self, log: Option<Vec<String>>) -> Result<Option<Vec<String>>> {
        let mut held = self
            .launch_log
            .lock()
            .map_err(|_| anyhow::anyhow!("launch log lock poisoned"))?;
        Ok(std::mem::replace(&mut *held, log))
    }

    /// Kernels launched so far while launches are logged (0 when they are not).
    pub(crate) fn launches_logged(&self) -> usize {
        self.launch_log
            .lock()
            .ok()
            .and_then(|l| l.as_ref().map(Vec::len))
            .unwrap_or(0)
    }

    /// Which kernels run the 4-bit prefill GEMMs: the options' choice, else the GPU's fastest.
    pub fn gemm_path(&self) -> GemmPath {
        self.gemm_path
    }

    /// Runs the 4-bit prefill GEMMs on `path` from now on (tests compare the paths on one GPU);
    /// an error where this GPU lacks it.
    pub fn set_gemm_path(&mut self, path: GemmPath) -> Result<()> {
        if !GemmPath::supported(&self.arch).contains(&path) {
            bail!("the {path:?} GEMM path is not available on {}", self.arch);
        }
        self.gemm_path = path;
        Ok(())
    }

    pub fn function(&self, name: &str) -> Result<&CudaFunction> {
        self.functions
            .get(name)
            .with_context(|| format!("kernel {name} is not compiled"))
    }

    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>> {
        Ok(self.stream.clone_htod(data)?)
    }

    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>> {
        Ok(self.stream.alloc_zeros(len.max(1))?)
    }

    pub fn download<T: DeviceRepr + Default + Clone>(&self, data: &CudaSlice<T>) -> Result<Vec<T>> {
        Ok(self.stream.clone_dtoh(data)?)
    }

    pub fn sync(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }

    /// Blocks of 256 threads of kernel `name` that the whole GPU holds at once (one wave),
    /// from the occupancy queried when the kernels were loaded (not during a graph capture).
    pub fn resident_blocks_256(&self, name: &str) -> Result<u32> {
        let per_sm = self
            .resident_256
            .get(name)
            .with_context(|| format!("no occupancy for kernel {name} at 256 threads"))?;
        Ok((*per_sm).max(1) * self.sms)
    }

    /// Free and total device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        Ok(self.ctx.mem_get_info()?)
    }
}

/// The raw device address of a buffer (or a view of one), for kernel arguments and structs
/// passed by value.
pub fn ptr<T, B: DevicePtr<T>>(buf: &B, stream: &CudaStream) -> u64 {
    buf.device_ptr(stream).0
}

/// Most sequences one decode step advances (kernels/common.cuh, MAX_ROWS).
pub const MAX_ROWS: usize = 8;

/// The kernels' `struct RowPtrs`: one buffer of each sequence of a step, row by row.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RowPtrs {
    pub p: [u64; MAX_ROWS],
}

/// The kernels' `struct RowInts`: one count of each sequence of a step.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RowInts {
    pub n: [i32; MAX_ROWS],
}

impl RowPtrs {
    /// The rows' addresses in order; rows past them stay null.
    pub fn of(addresses: impl IntoIterator<Item = u64>) -> Self {
        let mut rows = RowPtrs::default();
        rows.p.iter_mut().zip(addresses).for_each(|(r, a)| *r = a);
        rows
    }
}

impl RowInts {
    pub fn of(values: impl IntoIterator<Item = i32>) -> Self {
        let mut rows = RowInts::default();
        rows.n.iter_mut().zip(values).for_each(|(r, v)| *r = v);
        rows
    }
}

// SAFETY: plain-old-data with the C layouts of `struct RowPtrs` and `struct RowInts`.
unsafe impl DeviceRepr for RowPtrs {}
unsafe impl DeviceRepr for RowInts {}

/// A kernel argument by value.
#[derive(Clone, Copy, Debug)]
pub enum KArg {
    Ptr(u64),
    I32(i32),
    F32(f32),
    Mat(MatArg),
    Rows(RowPtrs),
    Ints(RowInts),
}

/// A launch shape: grid and block dimensions (dynamic shared memory: [`Gpu::launch_shared`]).
pub struct Shape {
    pub grid: (u32, u32, u32),
    pub block: u32,
}

impl Gpu {
    /// Runs `encode` with its launches allowed to begin before the previous kernel ends, where the
    /// GPU has it (programmatic stream serialisation, sm_90+): each kernel calls `pdl_wait()`
    /// (kernels/common.cuh) before it touches anything an earlier kernel writes, then lets its
    /// successor be scheduled, whose blocks are resident while it runs; the staged GEMVs use that
    /// time to request their weights, which no kernel writes. The decode step (~320 short dependent
    /// kernels) uses it: +4.6 % on the H200. Prefill does not: there its early-resident blocks
    /// slowed the GDN kernels by a third (64 -> 88 ms a 4K chunk), more than it gained elsewhere.
    pub fn programmatic<T>(&self, encode: impl FnOnce() -> Result<T>) -> Result<T> {
        self.pdl_now.store(self.pdl, Ordering::Relaxed);
        let out = encode();
        self.pdl_now.store(false, Ordering::Relaxed);
        out
    }

    /// Launches kernel `name` on the stream with its arguments (kernel_args.rs).
    pub fn launch(&self, name: &str, shape: Shape, args: &impl KernelArgs) -> Result<()> {
        self.launch_shared(name, shape, 0, args)
    }

    /// Launches kernel `name` with `shared` bytes of dynamic shared memory (above 48 KiB only for
    /// kernels that `Gpu::new` raised the limit of: each launcher's `dynamic_shared`).
    pub fn launch_shared(
        &self,
        name: &str,
        shape: Shape,
        shared: u32,
        args: &impl KernelArgs,
    ) -> Result<()> {
        let args = &args.args();
        let f = self.function(name)?;
        if let Ok(mut log) = self.launch_log.lock()
            && let Some(names) = log.as_mut()
        {
            names.push(name.to_string());
        }
        if self.pdl_now.load(Ordering::Relaxed) {
            return self
                .launch_pdl(f, &shape, shared, args)
                .with_context(|| format!("kernel {name}"));
        }
        let cfg = LaunchConfig {
            grid_dim: shape.grid,
            block_dim: (shape.block, 1, 1),
            shared_mem_bytes: shared,
        };
        let mut builder = self.stream.launch_builder(f);
        for a in args {
            match a {
                KArg::Ptr(v) => builder.arg(v),
                KArg::I32(v) => builder.arg(v),
                KArg::F32(v) => builder.arg(v),
                KArg::Mat(v) => builder.arg(v),
                KArg::Rows(v) => builder.arg(v),
                KArg::Ints(v) => builder.arg(v),
            };
        }
        // SAFETY: argument types and order follow the kernel signatures in kernels/*.cu (each
        // kernel's struct in kernel_args.rs, which tests/nvrtc.rs holds to the compiled
        // parameters), and every buffer outlives the stream's work.
        unsafe { builder.launch(cfg) }.map_err(|e| anyhow::anyhow!("kernel {name}: {e:?}"))?;
        Ok(())
    }

    fn launch_pdl(
        &self,
        f: &CudaFunction,
        shape: &Shape,
        shared: u32,
        args: &[KArg],
    ) -> Result<()> {
        // The driver reads each argument through a pointer; `values` outlives the call.
        let mut values = args.to_vec();
        let mut params: Vec<*mut c_void> = values
            .iter_mut()
            .map(|a| match a {
                KArg::Ptr(v) => v as *mut u64 as *mut c_void,
                KArg::I32(v) => v as *mut i32 as *mut c_void,
                KArg::F32(v) => v as *mut f32 as *mut c_void,
                KArg::Mat(v) => v as *mut MatArg as *mut c_void,
                KArg::Rows(v) => v as *mut RowPtrs as *mut c_void,
                KArg::Ints(v) => v as *mut RowInts as *mut c_void,
            })
            .collect();
        self.launch_raw(
            f,
            (shape.grid, shape.block),
            shared,
            &mut params,
            LaunchKind::Programmatic,
        )
    }

    /// Launches `f` with its arguments given as pointers to their values (`params`, in the
    /// kernel's parameter order), as `kind` says.
    pub fn launch_raw(
        &self,
        f: &CudaFunction,
        (grid, block): ((u32, u32, u32), u32),
        shared: u32,
        params: &mut [*mut c_void],
        kind: LaunchKind,
    ) -> Result<()> {
        use cudarc::driver::sys;
        self.ctx.bind_to_thread()?;
        let mut attr = match kind {
            LaunchKind::Plain => None,
            LaunchKind::Programmatic => Some(sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: [0; 4],
                value: sys::CUlaunchAttributeValue {
                    programmaticStreamSerializationAllowed: 1,
                },
            }),
            LaunchKind::Cooperative => Some(sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE,
                pad: [0; 4],
                value: sys::CUlaunchAttributeValue { cooperative: 1 },
            }),
        };
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared,
            hStream: self.stream.cu_stream(),
            attrs: attr.as_mut().map_or(std::ptr::null_mut(), |a| a as *mut _),
            numAttrs: attr.is_some() as u32,
        };
        // SAFETY: the caller passes pointers to values matching the kernel's signature, alive
        // until the call returns (the driver copies the values).
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()?
        };
        Ok(())
    }
}

/// How [`Gpu::launch_raw`] launches a kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchKind {
    Plain,
    /// Allowed to begin before the previous kernel ends (sm_90+; see [`Gpu::programmatic`]).
    Programmatic,
    /// Every block resident at once, or the launch fails (a grid barrier needs it).
    Cooperative,
}

/// `launch!(gpu, "name", grid, block, Args { .. })`: launches with a kernel's argument struct.
#[macro_export]
macro_rules! launch {
    ($gpu:expr, $name:expr, $grid:expr, $block:expr, $args:expr) => {
        $gpu.launch(
            $name,
            $crate::gpu::Shape {
                grid: $grid,
                block: $block,
            },
            &$args,
        )?
    };
}
