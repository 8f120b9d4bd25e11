//! Intel AMX (Advanced Matrix Extensions): detection, the process's permission to use the tile
//! registers, and each thread's tile configuration.
//!
//! Stable Rust has no AMX intrinsics or `target_feature` (rust-lang/rust #126622), so detection
//! reads CPUID and XCR0 directly and the kernels (`matmul_amx.rs`) are `asm!` blocks. Linux keeps
//! the tile data state off until a process asks for it (`arch_prctl(ARCH_REQ_XCOMP_PERM,
//! XFEATURE_XTILEDATA)`, Documentation/arch/x86/xstate.rst); without that the first tile
//! instruction raises SIGILL. The permission is per process, so threads started before the
//! request may use the tiles after it; each thread still loads its own tile configuration.

use std::sync::OnceLock;

/// True when this CPU has AMX-TILE and AMX-BF16, the OS saves the tile state, and this process
/// was granted it. Asked once per process; `MEGATRON_NO_AMX=1` answers false (to measure or test
/// the fallback on an AMX machine).
pub fn amx_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| std::env::var_os("MEGATRON_NO_AMX").is_none() && detect_and_request())
}

/// Why AMX is not used here, for logs and skipped tests; `None` when it is.
pub fn amx_unavailable_reason() -> Option<&'static str> {
    if amx_available() {
        None
    } else if std::env::var_os("MEGATRON_NO_AMX").is_some() {
        Some("MEGATRON_NO_AMX is set")
    } else if !cpu_has_amx_bf16() {
        Some("this CPU has no AMX-BF16 (amx_bf16 not in /proc/cpuinfo)")
    } else {
        Some("AVX512_BF16 is missing, or the OS did not grant the AMX tile state (XCR0 or arch_prctl refused)")
    }
}

#[cfg(target_arch = "x86_64")]
fn cpu_has_amx_bf16() -> bool {
    use std::arch::x86_64::__cpuid_count;
    #[allow(unused_unsafe)]
    // SAFETY: CPUID exists on every x86_64 CPU; leaf 7 is read only when the max leaf allows.
    unsafe {
        if __cpuid_count(0, 0).eax < 7 {
            return false;
        }
        let edx = __cpuid_count(7, 0).edx;
        // EDX bit 24: AMX-TILE, bit 22: AMX-BF16.
        edx & (1 << 24) != 0 && edx & (1 << 22) != 0
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_has_amx_bf16() -> bool {
    false
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect_and_request() -> bool {
    use std::arch::x86_64::__cpuid_count;
    // The packing routines convert with AVX512_BF16 (every AMX CPU has it).
    let avx512 = is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512bf16");
    if !cpu_has_amx_bf16() || !avx512 {
        return false;
    }
    #[allow(unused_unsafe)]
    // SAFETY: CPUID leaf 1 exists on every x86_64 CPU.
    let osxsave = unsafe { __cpuid_count(1, 0).ecx } & (1 << 27) != 0;
    if !osxsave {
        return false;
    }
    // SAFETY: XGETBV is enabled by the OS (OSXSAVE checked above).
    let xcr0 = unsafe { xcr0() };
    // Bits 17 (XTILECFG) and 18 (XTILEDATA): the OS saves the tile state.
    if xcr0 & 0x6_0000 != 0x6_0000 {
        return false;
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these arguments only changes this process's permitted xstate.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    rc == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect_and_request() -> bool {
    false
}

/// # Safety
/// The OS must have enabled XGETBV (CPUID.1:ECX.OSXSAVE).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
#[target_feature(enable = "xsave")]
unsafe fn xcr0() -> u64 {
    std::arch::x86_64::_xgetbv(0)
}

/// The one tile shape every AMX kernel here uses: all eight tiles 16 rows x 64 bytes (16 x 16
/// f32 accumulators, 16 x 32 bf16 A operands, 16 k-pair rows x 16 columns of B in VNNI order).
/// Ragged edges are zero-padded in the packed operands, so no kernel needs another shape.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

thread_local! {
    static CONFIGURED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Loads the tile configuration on the calling thread if it has not been loaded yet (the
/// configuration is thread state and stays until `tilerelease`, which nothing here runs).
///
/// # Safety
/// [`amx_available`] must be true.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn configure_tiles() {
    if CONFIGURED.with(|c| c.get()) {
        return;
    }
    let mut cfg = TileConfig {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        colsb: [0; 16],
        rows: [0; 16],
    };
    for t in 0..8 {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    // SAFETY: the process holds the tile permission (caller's contract); `cfg` is a valid
    // 64-byte palette-1 configuration.
    std::arch::asm!("ldtilecfg [{}]", in(reg) &cfg as *const TileConfig, options(nostack, readonly));
    CONFIGURED.with(|c| c.set(true));
}
