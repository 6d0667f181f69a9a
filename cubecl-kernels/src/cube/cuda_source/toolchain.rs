//! NVRTC (CUDA C++ to PTX) and ptxas through nvJitLink (PTX to machine code), the two steps
//! the CUDA runtime and driver take at a kernel's first launch.

use std::ffi::{CStr, CString};
use std::path::Path;

use super::target::{CudaKernelSource, CudaSourceError, CudaTarget};

/// Compiles `kernel` to PTX for `target` with NVRTC, with the options CubeCL's CUDA runtime
/// passes (architecture, include folder, line info). `include_dir` is the folder holding
/// `cuda_runtime.h` and `mma.h` (a CUDA toolkit's `include/`). Returns the PTX.
pub fn compile_with_nvrtc(
    kernel: &CudaKernelSource,
    target: &CudaTarget,
    include_dir: &Path,
) -> Result<String, CudaSourceError> {
    if !["cuda_runtime.h", "mma.h"]
        .iter()
        .all(|h| include_dir.join(h).is_file())
    {
        return Err(CudaSourceError::HeadersMissing {
            dir: include_dir.display().to_string(),
        });
    }
    // SAFETY: only tries to load the shared library and reports whether it was found.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaSourceError::NvrtcMissing);
    }
    let fail = |log: String| CudaSourceError::Compile {
        kernel: kernel.name.clone(),
        log,
    };
    let source = CString::new(kernel.source.as_str()).map_err(|e| fail(e.to_string()))?;
    let arch = format!("--gpu-architecture={}", target.sm());
    let include = format!("--include-path={}", include_dir.display());
    let options = [arch.as_str(), include.as_str(), "-lineinfo"];
    // SAFETY: NVRTC's C API on a program created here and destroyed before returning; the
    // source and option strings outlive the calls that read them.
    unsafe {
        use cudarc::nvrtc::result;
        let program =
            result::create_program(source.as_c_str(), None).map_err(|e| fail(format!("{e:?}")))?;
        let compiled = result::compile_program(program, &options);
        let outcome = match compiled {
            Ok(()) => result::get_ptx(program)
                .map_err(|e| fail(format!("{e:?}")))
                .map(|ptx| CStr::from_ptr(ptx.as_ptr()).to_string_lossy().into_owned()),
            Err(_) => Err(fail(match result::get_program_log(program) {
                Ok(log) => CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned(),
                Err(e) => format!("{e:?} (and no log)"),
            })),
        };
        let _ = result::destroy_program(program);
        outcome
    }
}

/// What ptxas reports for one kernel: its register and local-memory use on the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SassResources {
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of stack frame per thread.
    pub stack_frame_bytes: u32,
    /// Bytes of registers spilled to local memory per thread.
    pub spill_store_bytes: u32,
    /// Bytes reloaded from those spills per thread.
    pub spill_load_bytes: u32,
}

/// Assembles `ptx` (from [`compile_with_nvrtc`]) into machine code for `target` with ptxas,
/// through CUDA's nvJitLink library, and returns what ptxas reports. This is the step the
/// CUDA driver performs when it loads the PTX, so a kernel that passes it loads.
pub fn assemble_with_nvjitlink(
    kernel: &CudaKernelSource,
    ptx: &str,
    target: &CudaTarget,
) -> Result<SassResources, CudaSourceError> {
    type Handle = *mut std::ffi::c_void;
    // nvJitLink's C API (nvJitLink.h); every call returns 0 on success.
    type Create = unsafe extern "C" fn(*mut Handle, u32, *const *const std::ffi::c_char) -> i32;
    type AddData = unsafe extern "C" fn(
        Handle,
        i32,
        *const std::ffi::c_void,
        usize,
        *const std::ffi::c_char,
    ) -> i32;
    type Complete = unsafe extern "C" fn(Handle) -> i32;
    type LogSize = unsafe extern "C" fn(Handle, *mut usize) -> i32;
    type Log = unsafe extern "C" fn(Handle, *mut std::ffi::c_char) -> i32;
    type Destroy = unsafe extern "C" fn(*mut Handle) -> i32;
    /// `NVJITLINK_INPUT_PTX`.
    const INPUT_PTX: i32 = 2;

    let missing = |e: libloading::Error| CudaSourceError::NvJitLinkMissing {
        reason: e.to_string(),
    };
    let arch = format!("-arch={}", target.sm());
    let options = [
        CString::new(arch).map_err(|e| fail_assemble(kernel, -1, e.to_string()))?,
        c"-Xptxas=-v".to_owned(),
    ];
    let option_ptrs: Vec<_> = options.iter().map(|o| o.as_ptr()).collect();
    let name = c"kernel";
    let ptx_c = CString::new(ptx).map_err(|e| fail_assemble(kernel, -1, e.to_string()))?;
    // SAFETY: the symbols are nvJitLink's documented C API with the signatures above; the
    // handle is created, used and destroyed here, and every buffer passed outlives its call.
    unsafe {
        let lib = libloading::Library::new("libnvJitLink.so.13").map_err(missing)?;
        let create: libloading::Symbol<Create> = lib.get(b"nvJitLinkCreate").map_err(missing)?;
        let add: libloading::Symbol<AddData> = lib.get(b"nvJitLinkAddData").map_err(missing)?;
        let complete: libloading::Symbol<Complete> =
            lib.get(b"nvJitLinkComplete").map_err(missing)?;
        let info_size: libloading::Symbol<LogSize> =
            lib.get(b"nvJitLinkGetInfoLogSize").map_err(missing)?;
        let info: libloading::Symbol<Log> = lib.get(b"nvJitLinkGetInfoLog").map_err(missing)?;
        let error_size: libloading::Symbol<LogSize> =
            lib.get(b"nvJitLinkGetErrorLogSize").map_err(missing)?;
        let error: libloading::Symbol<Log> = lib.get(b"nvJitLinkGetErrorLog").map_err(missing)?;
        let destroy: libloading::Symbol<Destroy> = lib.get(b"nvJitLinkDestroy").map_err(missing)?;
        let read = |handle: Handle, size: &LogSize, log: &Log| {
            let mut len = 0usize;
            if size(handle, &mut len) != 0 {
                return String::new();
            }
            let mut buf = vec![0u8; len + 1];
            if log(handle, buf.as_mut_ptr().cast()) != 0 {
                return String::new();
            }
            CStr::from_bytes_until_nul(&buf)
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        };
        let mut handle: Handle = std::ptr::null_mut();
        let code = create(&mut handle, option_ptrs.len() as u32, option_ptrs.as_ptr());
        if code != 0 {
            return Err(fail_assemble(kernel, code, "nvJitLinkCreate failed".into()));
        }
        // PTX is text: nvJitLink reads it as a C string, so it gets its terminating NUL.
        let mut code = add(
            handle,
            INPUT_PTX,
            ptx_c.as_ptr().cast(),
            ptx_c.as_bytes_with_nul().len(),
            name.as_ptr(),
        );
        if code == 0 {
            code = complete(handle);
        }
        let outcome = if code == 0 {
            Ok(parse_ptxas_info(&read(handle, &info_size, &info)))
        } else {
            Err(fail_assemble(
                kernel,
                code,
                read(handle, &error_size, &error),
            ))
        };
        destroy(&mut handle);
        outcome
    }
}

fn fail_assemble(kernel: &CudaKernelSource, code: i32, log: String) -> CudaSourceError {
    CudaSourceError::Assemble {
        kernel: kernel.name.clone(),
        code,
        log,
    }
}

/// Reads `ptxas -v`'s "N bytes stack frame, N bytes spill stores, N bytes spill loads" and
/// "Used N registers" lines.
fn parse_ptxas_info(log: &str) -> SassResources {
    let number_before = |line: &str, what: &str| -> Option<u32> {
        let end = line.find(what)?;
        line[..end].split_whitespace().last()?.parse().ok()
    };
    let mut out = SassResources::default();
    for line in log.lines() {
        if let Some(n) = number_before(line, " bytes stack frame") {
            out.stack_frame_bytes = n;
        }
        if let Some(n) = number_before(line, " bytes spill stores") {
            out.spill_store_bytes = n;
        }
        if let Some(n) = number_before(line, " bytes spill loads") {
            out.spill_load_bytes = n;
        }
        if let Some(n) = number_before(line, " registers") {
            out.registers = n;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_ptxas_resource_lines() {
        let log = "ptxas info    : 0 bytes gmem\n\
                   ptxas info    : Compiling entry function 'k' for 'sm_90a'\n\
                   ptxas info    : Function properties for k\n\
                   ptxas         .     176 bytes stack frame, 268 bytes spill stores, 196 bytes spill loads\n\
                   ptxas info    : Used 255 registers, used 1 barriers\n\
                   ptxas info    : Compile time = 104.477 ms\n";
        assert_eq!(
            parse_ptxas_info(log),
            SassResources {
                registers: 255,
                stack_frame_bytes: 176,
                spill_store_bytes: 268,
                spill_load_bytes: 196,
            }
        );
    }
}
