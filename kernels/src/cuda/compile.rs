//! Run-time compilation: each `.cu` file under `kernels/src/cuda/` is one
//! module, embedded in the binary, compiled by NVRTC for the device's exact
//! architecture the first time one of its kernels is launched, and cached for
//! the life of the process (per device ordinal, shared by all handles).

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys, Ptx};

use crate::error::{KernelError, Result};

/// Source prepended to every module: dtype helpers, error records, reductions.
const COMMON: &str = include_str!("common.cuh");

/// One embedded `.cu` file.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Module {
    /// Name used in messages and as the cache key.
    pub(crate) name: &'static str,
    /// CUDA C source (without [`COMMON`]).
    pub(crate) src: &'static str,
}

/// Elementwise maps, casts, fills and reductions.
pub(crate) const ELEMENTWISE: Module = Module {
    name: "elementwise.cu",
    src: include_str!("elementwise.cu"),
};
/// The grouped GEMM and its weight gradient.
pub(crate) const LINALG: Module = Module {
    name: "linalg.cu",
    src: include_str!("linalg.cu"),
};
/// The Hopper (sm_90a) grouped GEMMs on TMA and wgmma (empty elsewhere).
pub(crate) const GROUPED_SM90: Module = Module {
    name: "grouped_sm90.cu",
    src: include_str!("grouped_sm90.cu"),
};
/// The Hopper (sm_90a) blockwise fp8 grouped GEMM on TMA and wgmma (empty
/// elsewhere).
pub(crate) const FP8_SM90: Module = Module {
    name: "fp8_sm90.cu",
    src: include_str!("fp8_sm90.cu"),
};
/// The Hopper (sm_90a) attention kernels on TMA and wgmma (empty elsewhere).
pub(crate) const ATTENTION_SM90: Module = Module {
    name: "attention_sm90.cu",
    src: include_str!("attention_sm90.cu"),
};
/// RMSNorm and RoPE.
pub(crate) const NORM: Module = Module {
    name: "norm.cu",
    src: include_str!("norm.cu"),
};
/// Cross-entropy and the valid-token mask.
pub(crate) const LOSS: Module = Module {
    name: "loss.cu",
    src: include_str!("loss.cu"),
};
/// The fused AdamW step.
pub(crate) const OPTIM: Module = Module {
    name: "optim.cu",
    src: include_str!("optim.cu"),
};

/// Every module, for checks that compile them all.
#[cfg(test)]
pub(crate) const ALL: [Module; 11] = [
    ELEMENTWISE,
    LINALG,
    GROUPED_SM90,
    ATTENTION_SM90,
    NORM,
    LOSS,
    OPTIM,
    ATTENTION,
    ROUTING,
    FP8,
    FP8_SM90,
];

/// Causal grouped-query attention, forward and backward.
pub(crate) const ATTENTION: Module = Module {
    name: "attention.cu",
    src: include_str!("attention.cu"),
};
/// Top-k, gathers, embeddings, routing plans and the dispatcher permutations.
pub(crate) const ROUTING: Module = Module {
    name: "routing.cu",
    src: include_str!("routing.cu"),
};

/// fp8 (e4m3) compression of saved activations, 1×128 block scales.
pub(crate) const FP8: Module = Module {
    name: "fp8.cu",
    src: include_str!("fp8.cu"),
};

/// A compiled module and the kernels looked up in it so far.
pub(crate) struct Loaded {
    module: Arc<CudaModule>,
    functions: Mutex<HashMap<String, CudaFunction>>,
}

impl Loaded {
    /// The kernel `name` of this module.
    pub(crate) fn function(&self, module: &str, name: &str) -> Result<CudaFunction> {
        let mut f = self.functions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(func) = f.get(name) {
            return Ok(func.clone());
        }
        let func = self
            .module
            .load_function(name)
            .map_err(|e| KernelError::DeviceUnavailable {
                device: "cuda",
                reason: format!("kernel {name} not found in {module}: {e:?}"),
            })?;
        f.insert(name.to_string(), func.clone());
        Ok(func)
    }
}

/// One slot per (ordinal, module): the first caller compiles, concurrent
/// callers wait on the same `OnceLock`; a failure is kept so every later
/// launch reports the same compile error.
type Slot = Arc<OnceLock<std::result::Result<Arc<Loaded>, KernelError>>>;

fn slots() -> &'static Mutex<HashMap<(usize, &'static str), Slot>> {
    static SLOTS: OnceLock<Mutex<HashMap<(usize, &'static str), Slot>>> = OnceLock::new();
    SLOTS.get_or_init(Default::default)
}

/// The loaded module `m` for `ctx`, compiling it for `arch` on first use.
pub(crate) fn module(ctx: &Arc<CudaContext>, arch: &str, m: Module) -> Result<Arc<Loaded>> {
    let slot = slots()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry((ctx.ordinal(), m.name))
        .or_default()
        .clone();
    slot.get_or_init(|| {
        let cubin = compile(m, arch)?;
        let module = ctx.load_module(Ptx::from_binary(cubin)).map_err(|e| {
            KernelError::DeviceUnavailable {
                device: "cuda",
                reason: format!("loading the compiled {} for {arch}: {e:?}", m.name),
            }
        })?;
        Ok(Arc::new(Loaded {
            module,
            functions: Mutex::new(HashMap::new()),
        }))
    })
    .clone()
}

/// Where the CUDA headers (`cuda_bf16.h`) are: `$CUDA_HOME`, `$CUDA_PATH`,
/// else `/usr/local/cuda`.
fn cuda_include_dir() -> String {
    let root = std::env::var("CUDA_HOME")
        .or_else(|_| std::env::var("CUDA_PATH"))
        .unwrap_or_else(|_| "/usr/local/cuda".to_string());
    format!("{root}/include")
}

/// `FOLDMOE_GEMM_SKEW=B[,F[,W]]`: the consumer warpgroups' skew, in
/// pipeline steps, of the bf16 grouped GEMMs (B), the fp8 forward and data
/// gradient (F, else B) and the fp8 weight gradient (W, else F), as `-D`
/// options (common.cuh's `WgSkew`; unset: the sources' defaults; for
/// comparisons). Steps past a kernel's ring are clamped there.
fn skew_defines() -> std::result::Result<Vec<String>, String> {
    env_defines("FOLDMOE_GEMM_SKEW", skew_defines_of)
}

/// The `-D` options `parse` makes of environment variable `var` (none when
/// it is unset).
fn env_defines(
    var: &str,
    parse: impl Fn(&str) -> std::result::Result<Vec<String>, String>,
) -> std::result::Result<Vec<String>, String> {
    std::env::var(var).map_or(Ok(Vec::new()), |v| parse(&v))
}

/// [`skew_defines`] of the variable's value `v`.
fn skew_defines_of(v: &str) -> std::result::Result<Vec<String>, String> {
    let steps: Vec<u32> = v
        .split(',')
        .map(|x| x.trim().parse::<u32>())
        .collect::<std::result::Result<_, _>>()
        .ok()
        .filter(|s: &Vec<u32>| (1..=3).contains(&s.len()) && s.iter().all(|&x| x <= 16))
        .ok_or_else(|| {
            format!("FOLDMOE_GEMM_SKEW={v:?}: expected B, B,F or B,F,W, each 0..=16 pipeline steps")
        })?;
    let at = |i: usize| steps[i.min(steps.len() - 1)];
    Ok(vec![
        format!("-DFOLDMOE_GW_SKEW={}", at(0)),
        format!("-DFOLDMOE_F8_SKEW={}", at(1)),
        format!("-DFOLDMOE_F8W_SKEW={}", at(2)),
    ])
}

/// The fp8 GEMM's switches (fp8_sm90.cu; unset: the source's defaults; for
/// comparisons): `FOLDMOE_F8_PREFETCH`, whether each step loads the next
/// block's scales rather than its own, and `FOLDMOE_F8_OVERLAP`, whether a
/// tile's store runs under the next tile's first wgmmas.
const F8_SWITCHES: [&str; 2] = ["FOLDMOE_F8_PREFETCH", "FOLDMOE_F8_OVERLAP"];

/// Each of [`F8_SWITCHES`] that is set, `VAR=0|1`, as `-DVAR=0|1`.
fn switch_defines() -> std::result::Result<Vec<String>, String> {
    let mut defines = Vec::new();
    for var in F8_SWITCHES {
        defines.extend(env_defines(var, |v| switch_defines_of(var, v))?);
    }
    Ok(defines)
}

/// [`switch_defines`] of switch `var`'s value `v`.
fn switch_defines_of(var: &str, v: &str) -> std::result::Result<Vec<String>, String> {
    switch_value(var, v).map(|on| vec![format!("-D{var}={}", on as u8)])
}

/// A 0|1 switch's value `v` (of variable `var`, named in the error).
fn switch_value(var: &str, v: &str) -> std::result::Result<bool, String> {
    match v.trim() {
        "0" => Ok(false),
        "1" => Ok(true),
        _ => Err(format!("{var}={v:?}: expected 0 or 1")),
    }
}

/// A 0|1 switch read from the environment: `None` when `var` is unset.
pub(super) fn env_switch(var: &str) -> std::result::Result<Option<bool>, String> {
    std::env::var(var).map_or(Ok(None), |v| switch_value(var, &v).map(Some))
}

/// Compiles `m` to a CUBIN for `arch` (`sm_90a`, ...).
fn compile(m: Module, arch: &str) -> Result<Vec<u8>> {
    let fail = |what: String| KernelError::DeviceUnavailable {
        device: "cuda",
        reason: format!("NVRTC could not compile {} for {arch}: {what}", m.name),
    };
    let src = CString::new(format!("{COMMON}\n{}", m.src))
        .map_err(|_| fail("the source holds a NUL byte".into()))?;
    let name = CString::new(m.name).map_err(|_| fail("bad module name".into()))?;
    let include = cuda_include_dir();
    let mut opts = vec![
        format!("--gpu-architecture={arch}"),
        format!("--include-path={include}"),
        "--std=c++17".to_string(),
        // Kernels are compared with the CPU reference at 1e-5: keep IEEE
        // division, square roots and denormals.
        "--ftz=false".to_string(),
        "--prec-div=true".to_string(),
        "--prec-sqrt=true".to_string(),
    ];
    opts.extend(skew_defines().map_err(fail)?);
    opts.extend(switch_defines().map_err(fail)?);
    let prog = nvrtc::create_program(&src, Some(&name)).map_err(|e| fail(format!("{e:?}")))?;
    let out = (|| {
        if let Err(e) = unsafe { nvrtc::compile_program(prog, &opts) } {
            let log = unsafe { nvrtc::get_program_log(prog) }
                .map(|l| {
                    unsafe { CStr::from_ptr(l.as_ptr()) }
                        .to_string_lossy()
                        .into_owned()
                })
                .unwrap_or_default();
            let hint = if log.contains("cuda_bf16.h") {
                format!(
                    " (cuda_bf16.h not found under {include}: set CUDA_HOME to the CUDA toolkit)"
                )
            } else {
                String::new()
            };
            return Err(fail(format!("{e:?}{hint}\n{log}")));
        }
        let mut size = 0usize;
        unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size) }
            .result()
            .map_err(|e| fail(format!("nvrtcGetCUBINSize: {e:?}")))?;
        let mut cubin = vec![0u8; size];
        unsafe { nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()) }
            .result()
            .map_err(|e| fail(format!("nvrtcGetCUBIN: {e:?}")))?;
        Ok(cubin)
    })();
    let _ = unsafe { nvrtc::destroy_program(prog) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `FOLDMOE_GEMM_SKEW`: a missing field repeats the one before it; bad
    /// values are errors naming the value.
    #[test]
    fn skew_values_fill_and_reject() {
        let d = |v| skew_defines_of(v).unwrap().join(" ");
        assert_eq!(
            d("2"),
            "-DFOLDMOE_GW_SKEW=2 -DFOLDMOE_F8_SKEW=2 -DFOLDMOE_F8W_SKEW=2"
        );
        assert_eq!(
            d("0, 4"),
            "-DFOLDMOE_GW_SKEW=0 -DFOLDMOE_F8_SKEW=4 -DFOLDMOE_F8W_SKEW=4"
        );
        assert_eq!(
            d("1,2,6"),
            "-DFOLDMOE_GW_SKEW=1 -DFOLDMOE_F8_SKEW=2 -DFOLDMOE_F8W_SKEW=6"
        );
        for bad in ["", "x", "1,2,3,4", "17", "-1", "1,,2"] {
            let e = skew_defines_of(bad).unwrap_err();
            assert!(e.contains(&format!("{bad:?}")), "{bad}: {e}");
        }
    }

    /// The body of each kernel entry point of `src`, from its first
    /// statement on (blanks and line continuations skipped): entries are
    /// `extern "C" __global__` or an object-like macro defined as it (a
    /// `#define NAME extern "C" __global__` line; not that line itself), then an
    /// optional `__launch_bounds__(..)`, the name and the balanced parameter
    /// list up to the `{`. Each comes with its first 80 characters (for
    /// messages).
    fn entry_bodies(src: &str) -> Vec<(String, &str)> {
        const GLOBAL: &str = "extern \"C\" __global__";
        let defines = |line: &str| -> Option<String> {
            let rest = line.trim_start().strip_prefix("#define")?;
            let (name, body) = rest.trim_start().split_once(char::is_whitespace)?;
            // Object-like only: a function-like macro stamps out entries.
            (!name.contains('(') && body.trim_start().starts_with(GLOBAL)).then(|| name.to_string())
        };
        let mut markers = vec![GLOBAL.to_string()];
        markers.extend(src.lines().filter_map(defines));
        let closing = |from: usize| -> usize {
            let mut depth = 0;
            for (i, c) in src[from..].char_indices() {
                match c {
                    '(' => depth += 1,
                    ')' if depth == 1 => return from + i + 1,
                    ')' => depth -= 1,
                    _ => {}
                }
            }
            panic!(
                "unbalanced parentheses after {}",
                &src[from..(from + 60).min(src.len())]
            );
        };
        let blanks = [' ', '\t', '\n', '\\'];
        let mut out = Vec::new();
        let mut at = 0;
        while let Some((pos, len)) = markers
            .iter()
            .filter_map(|m| src[at..].find(m.as_str()).map(|p| (at + p, m.len())))
            .min()
        {
            at = pos + len;
            let line_start = src[..pos].rfind('\n').map_or(0, |i| i + 1);
            let line_end = src[pos..].find('\n').map_or(src.len(), |i| pos + i);
            if defines(&src[line_start..line_end]).is_some() {
                continue;
            }
            let mut open = src[at..].find('(').expect("an entry's parameters") + at;
            if let Some(lb) = src[at..open].find("__launch_bounds__") {
                let after = closing(at + lb);
                open = src[after..].find('(').expect("an entry's parameters") + after;
            }
            let end = closing(open);
            let rest = src[end..].trim_start_matches(blanks);
            assert!(rest.starts_with('{'), "no body after {}", &src[pos..end]);
            out.push((
                src[pos..(pos + 80).min(src.len())].to_string(),
                rest[1..].trim_start_matches(blanks),
            ));
        }
        out
    }

    /// Programmatic dependent launches (`FOLDMOE_PDL=1`) are only safe if
    /// every kernel waits for the one before it before touching memory:
    /// each entry point of every module opens with `pdl_enter();`.
    #[test]
    fn every_kernel_opens_with_pdl_enter() {
        let mut entries = 0;
        for m in ALL {
            let bodies = entry_bodies(m.src);
            assert!(
                !bodies.is_empty(),
                "{}: no kernel entry point found",
                m.name
            );
            for (entry, body) in bodies {
                assert!(
                    body.starts_with("pdl_enter();"),
                    "{}: this kernel does not open with pdl_enter(): {entry}",
                    m.name
                );
                entries += 1;
            }
        }
        assert!(entries >= 100, "only {entries} kernel entry points found");
        // The scanner itself: plain, macro-stamped and *_ENTRY kernels, with
        // and without __launch_bounds__, and one that forgets.
        let src = "#define MY_ENTRY extern \"C\" __global__ void __launch_bounds__(T, 1)\n\
                   extern \"C\" __global__ void a(int x) { pdl_enter(); }\n\
                   #define M(s) extern \"C\" __global__ void __launch_bounds__(256) b_##s(f(int) x) { \\\n  pdl_enter(); }\n\
                   MY_ENTRY c(int y,\n int z)\n{ g(); }\n";
        let found: Vec<bool> = entry_bodies(src)
            .iter()
            .map(|(_, b)| b.starts_with("pdl_enter();"))
            .collect();
        assert_eq!(found, [true, true, false]);
    }

    /// Each fp8 switch takes 0 or 1; anything else is an error naming the
    /// variable and the value.
    #[test]
    fn switch_values_parse_and_reject() {
        for var in F8_SWITCHES {
            assert_eq!(switch_defines_of(var, "0").unwrap(), [format!("-D{var}=0")]);
            assert_eq!(
                switch_defines_of(var, " 1").unwrap(),
                [format!("-D{var}=1")]
            );
            for bad in ["", "2", "yes", "-1"] {
                let e = switch_defines_of(var, bad).unwrap_err();
                assert!(
                    e.contains(var) && e.contains(&format!("{bad:?}")),
                    "{bad}: {e}"
                );
            }
        }
    }

    /// NVRTC needs no GPU: wherever the library is found, every module must
    /// compile for Hopper and Ampere, so a CUDA C error shows up before a GPU
    /// run (CI without the library skips, saying so).
    #[test]
    fn every_module_compiles_with_nvrtc() {
        if !unsafe { nvrtc_sys::is_culib_present() } {
            eprintln!("skipping: NVRTC (libnvrtc.so) not found");
            return;
        }
        for arch in ["sm_90a", "sm_80"] {
            for m in ALL {
                let cubin = compile(m, arch).unwrap_or_else(|e| panic!("{e}"));
                assert!(!cubin.is_empty(), "{} for {arch}", m.name);
            }
        }
    }
}
