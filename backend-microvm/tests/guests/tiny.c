/* A tiny freestanding guest for backend-microvm's tests. It runs at CPL 3 in 64-bit mode,
 * set up by the VMM: rdi = vCPU index, rsi = test selector, rdx = RAM size. It talks to the
 * world with `out` (serial at 0x3f8, exit code at 0x501) and MMIO (virtio at 0xd0000000). */

#define SERIAL 0x3f8
#define EXIT_PORT 0x501
#define VIRTIO 0xd0000000UL
/* A word the host writes to release a guest that waits (snapshot / pause tests). */
#define GO_FLAG ((volatile unsigned int *)0x300000UL)
/* Where vCPU 1 reports in (multi-vCPU test). */
#define AP_FLAG ((volatile unsigned int *)0x300040UL)

__asm__(".globl _start\n"
        "_start:\n"
        "  and $-16, %rsp\n"
        "  call cmain\n"
        "  mov $0x501, %dx\n"
        "  out %eax, %dx\n"
        "1: jmp 1b\n");

static inline void outb(unsigned short port, unsigned char v) {
    __asm__ volatile("outb %0, %1" : : "a"(v), "Nd"(port));
}
static inline void outl(unsigned short port, unsigned int v) {
    __asm__ volatile("outl %0, %1" : : "a"(v), "Nd"(port));
}
static inline void barrier(void) { __asm__ volatile("" ::: "memory"); }

static void puts_(const char *s) {
    while (*s) outb(SERIAL, (unsigned char)*s++);
}
static void puthex(unsigned long v) {
    char buf[19];
    buf[0] = '0';
    buf[1] = 'x';
    for (int i = 0; i < 16; i++) buf[2 + i] = "0123456789abcdef"[(v >> (60 - 4 * i)) & 15];
    buf[18] = 0;
    puts_(buf);
}
static void exit_(unsigned int code) {
    outl(EXIT_PORT, code);
    for (;;) {}
}

/* ---- computation (snapshot tests) ---- */
static unsigned long compute(unsigned long n, int pause_halfway) {
    unsigned long x = 0x9e3779b97f4a7c15UL, acc = 0;
    for (unsigned long i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        acc += x ^ i;
        if (pause_halfway && i == n / 2) {
            puts_("H");
            while (*GO_FLAG == 0) {}
        }
    }
    return acc;
}

/* ---- virtio-mmio console driver (polling, no interrupts) ---- */
struct desc {
    unsigned long addr;
    unsigned int len;
    unsigned short flags, next;
};
#define QSZ 8
struct queue {
    struct desc d[QSZ] __attribute__((aligned(16)));
    volatile unsigned short avail[3 + QSZ] __attribute__((aligned(2)));
    volatile unsigned int used[1 + 2 * QSZ + 1] __attribute__((aligned(4)));
};
static struct queue q[2] __attribute__((aligned(4096)));
static char rxbuf[256];
static const char ping[] = "ping from the guest";

/* The virtio-mmio window vr/vw talk to: the console (device 0) unless a test picks another. */
static unsigned long vbase = VIRTIO;
static inline unsigned int vr(unsigned long off) { return *(volatile unsigned int *)(vbase + off); }
static inline void vw(unsigned long off, unsigned int v) { *(volatile unsigned int *)(vbase + off) = v; }

static int setup_queue(int i, unsigned long desc, unsigned long avail, unsigned long used) {
    vw(0x30, i);
    if (vr(0x34) < QSZ) return 0;
    vw(0x38, QSZ);
    vw(0x80, (unsigned int)desc);
    vw(0x84, (unsigned int)(desc >> 32));
    vw(0x90, (unsigned int)avail);
    vw(0x94, (unsigned int)(avail >> 32));
    vw(0xa0, (unsigned int)used);
    vw(0xa4, (unsigned int)(used >> 32));
    vw(0x44, 1);
    return 1;
}

/* Resets and negotiates device `id` at vbase: VERSION_1 plus the low feature bits `feat`,
 * which the device must offer. */
static int virtio_init_dev(unsigned int id, unsigned int feat) {
    if (vr(0x00) != 0x74726976 || vr(0x04) != 2 || vr(0x08) != id) return 0;
    vw(0x70, 0);
    vw(0x70, 1 | 2);
    vw(0x14, 1);
    if (!(vr(0x10) & 1)) return 0; /* VERSION_1 */
    vw(0x14, 0);
    if ((vr(0x10) & feat) != feat) return 0;
    vw(0x24, 1);
    vw(0x20, 1);
    vw(0x24, 0);
    vw(0x20, feat);
    vw(0x70, 1 | 2 | 8);
    if (!(vr(0x70) & 8)) return 0;
    return 1;
}
static int virtio_init(void) { return virtio_init_dev(3, 0); }

static unsigned int console_echo(void) {
    if (!virtio_init()) return 101;
    for (int i = 0; i < 2; i++)
        if (!setup_queue(i, (unsigned long)q[i].d, (unsigned long)q[i].avail, (unsigned long)q[i].used))
            return 102;
    vw(0x70, 1 | 2 | 8 | 4);
    /* A receive buffer. */
    q[0].d[0].addr = (unsigned long)rxbuf;
    q[0].d[0].len = sizeof(rxbuf);
    q[0].d[0].flags = 2; /* WRITE */
    q[0].avail[2] = 0;
    barrier();
    q[0].avail[1] = 1;
    vw(0x50, 0);
    /* Transmit the request. */
    q[1].d[0].addr = (unsigned long)ping;
    q[1].d[0].len = sizeof(ping) - 1;
    q[1].d[0].flags = 0;
    q[1].avail[2] = 0;
    barrier();
    q[1].avail[1] = 1;
    vw(0x50, 1);
    /* Poll the used rings (no interrupts at CPL 3). */
    while ((q[1].used[0] >> 16) == 0) {}
    while ((q[0].used[0] >> 16) == 0) {}
    barrier();
    unsigned int len = q[0].used[2];
    if (len > sizeof(rxbuf)) return 103;
    puts_("guest got: ");
    for (unsigned int i = 0; i < len; i++) outb(SERIAL, rxbuf[i]);
    puts_("\n");
    return 0;
}

/* A queue whose descriptor table lies outside RAM: the device must refuse it. */
static unsigned int virtio_garbage_addr(void) {
    if (!virtio_init()) return 101;
    setup_queue(1, 0xffff0000000UL, (unsigned long)q[1].avail, (unsigned long)q[1].used);
    vw(0x70, 1 | 2 | 8 | 4);
    return vr(0x70); /* NEEDS_RESET (64) must be set */
}

/* Valid rings full of garbage: head index out of range, then a descriptor loop. */
static unsigned int virtio_garbage_ring(unsigned long ram) {
    if (!virtio_init()) return 101;
    for (int i = 0; i < 2; i++)
        setup_queue(i, (unsigned long)q[i].d, (unsigned long)q[i].avail, (unsigned long)q[i].used);
    vw(0x70, 1 | 2 | 8 | 4);
    q[1].d[0].addr = ram - 8; /* runs off the end of RAM */
    q[1].d[0].len = 4096;
    q[1].d[0].flags = 1; /* NEXT */
    q[1].d[0].next = 0;  /* and loops */
    q[1].avail[2] = 77;  /* head out of range */
    barrier();
    q[1].avail[1] = 60000; /* far ahead */
    vw(0x50, 1);
    while (!(vr(0x70) & 64)) {}
    return vr(0x70);
}

/* ---- virtio-net at the first virtio-mmio slot (tests attach it alone) ---- */
#define NET_MAC (1u << 5)
#define NET_HDR 12
static unsigned char net_rx[2][256] __attribute__((aligned(16)));
static unsigned char net_tx[128] __attribute__((aligned(16)));
static unsigned short net_sent;
static const char net_payload[] = "frame from the guest";

static int net_init(int rx_buffers) {
    vbase = VIRTIO;
    if (!virtio_init_dev(1, NET_MAC)) return 0;
    for (int i = 0; i < 2; i++)
        if (!setup_queue(i, (unsigned long)q[i].d, (unsigned long)q[i].avail, (unsigned long)q[i].used))
            return 0;
    vw(0x70, 1 | 2 | 8 | 4);
    for (int i = 0; i < rx_buffers; i++) {
        q[0].d[i].addr = (unsigned long)net_rx[i];
        q[0].d[i].len = sizeof(net_rx[i]);
        q[0].d[i].flags = 2; /* WRITE */
        q[0].avail[2 + i] = i;
    }
    barrier();
    q[0].avail[1] = rx_buffers;
    vw(0x50, 0);
    return 1;
}

/* Sends `len` bytes of net_tx as one chain and waits until the device has taken it. */
static void net_send(unsigned int len) {
    unsigned short k = net_sent++;
    q[1].d[k % QSZ].addr = (unsigned long)net_tx;
    q[1].d[k % QSZ].len = len;
    q[1].d[k % QSZ].flags = 0;
    q[1].avail[2 + k % QSZ] = k % QSZ;
    barrier();
    q[1].avail[1] = k + 1;
    vw(0x50, 1);
    while ((unsigned short)(q[1].used[0] >> 16) != (unsigned short)(k + 1)) {}
}

/* A broadcast frame of EtherType 0x88b5 (local experimental) carrying net_payload. */
static unsigned int net_frame(void) {
    for (int i = 0; i < NET_HDR; i++) net_tx[i] = 0;
    for (int i = 0; i < 6; i++) {
        net_tx[NET_HDR + i] = 0xff;
        net_tx[NET_HDR + 6 + i] = *(volatile unsigned char *)(vbase + 0x100 + i);
    }
    net_tx[NET_HDR + 12] = 0x88;
    net_tx[NET_HDR + 13] = 0xb5;
    unsigned int n = NET_HDR + 14;
    for (const char *p = net_payload; *p; p++) net_tx[n++] = (unsigned char)*p;
    return n;
}

/* Prints the payload of used receive entry `i` ("guest got: ..."); 0 if it is too short. */
static int net_print_rx(int i) {
    unsigned int id = q[0].used[1 + 2 * i], len = q[0].used[2 + 2 * i];
    if (id > 1 || len > sizeof(net_rx[0]) || len <= NET_HDR + 14) return 0;
    if (net_rx[id][10] != 1) return 0; /* num_buffers */
    puts_("guest got: ");
    for (unsigned int j = NET_HDR + 14; j < len; j++) outb(SERIAL, net_rx[id][j]);
    puts_("\n");
    return 1;
}

/* Sends one frame, then prints the first frame it receives. */
static unsigned int net_echo(void) {
    if (!net_init(1)) return 151;
    puts_("mac ");
    for (int i = 0; i < 6; i++) puthex(*(volatile unsigned char *)(vbase + 0x100 + i));
    puts_("\n");
    net_send(net_frame());
    while ((q[0].used[0] >> 16) == 0) {}
    barrier();
    return net_print_rx(0) ? 15 : 152;
}

/* A chain shorter than the virtio header, then a good frame; after GO_FLAG (when asked)
 * one more good frame. */
static unsigned int net_bad_then_good(int wait) {
    if (!net_init(0)) return 161;
    unsigned int n = net_frame();
    net_send(4);
    net_send(n);
    if (wait) {
        puts_("W");
        while (*GO_FLAG == 0) {}
        net_send(n);
        net_send(n);
    }
    return 16;
}

/* Two 256-byte receive buffers; the host sends a frame too large for them, then a small
 * one (and floods more): the first comes back empty, the second holds the small frame. */
static unsigned int net_small_buffers(void) {
    if (!net_init(2)) return 171;
    puts_("R");
    while ((unsigned short)(q[0].used[0] >> 16) < 2) {}
    barrier();
    if (q[0].used[2] != 0) return 172;
    return net_print_rx(1) ? 17 : 173;
}

/* ---- virtio-blk (read-only) at the second virtio-mmio slot ---- */
#define BLK_RO (1u << 5)
#define BLK_SEG_MAX (1u << 2)
static struct {
    unsigned int type, reserved;
    unsigned long sector;
} blk_hdr;
static unsigned char blk_data[1024];
static char blk_id[20];
static volatile unsigned char blk_status;
static unsigned short blk_idx;

/* Publishes the chain at descriptor 0 and waits for the device to use it. Returns the used
 * length. */
static unsigned int blk_submit(void) {
    q[0].avail[2 + blk_idx % QSZ] = 0;
    barrier();
    blk_idx++;
    q[0].avail[1] = blk_idx;
    vw(0x50, 0);
    while ((unsigned short)(q[0].used[0] >> 16) != blk_idx) {}
    barrier();
    return q[0].used[2 + 2 * ((blk_idx - 1) % QSZ)];
}

static void blk_desc(int i, void *addr, unsigned int len, unsigned short flags) {
    q[0].d[i].addr = (unsigned long)addr;
    q[0].d[i].len = len;
    q[0].d[i].flags = flags;
    q[0].d[i].next = i + 1;
}

static void blk_request(unsigned int type, unsigned long sector) {
    blk_hdr.type = type;
    blk_hdr.reserved = 0;
    blk_hdr.sector = sector;
    blk_status = 0xff;
    blk_desc(0, &blk_hdr, sizeof(blk_hdr), 1 /* NEXT */);
}

static void blk_report(const char *what, unsigned int len) {
    puts_(what);
    puts_(" status ");
    puthex(blk_status);
    puts_(" len ");
    puthex(len);
    puts_("\n");
}

/* Reads 2 sectors from sector 1 over three data descriptors and prints an FNV-1a hash of
 * them. */
static void blk_in(void) {
    for (int i = 0; i < 1024; i++) blk_data[i] = 0x5a ^ (unsigned char)i;
    blk_request(0, 1);
    blk_desc(1, blk_data, 100, 1 | 2);
    blk_desc(2, blk_data + 100, 700, 1 | 2);
    blk_desc(3, blk_data + 800, 224, 1 | 2);
    blk_desc(4, (void *)&blk_status, 1, 2);
    unsigned int len = blk_submit();
    unsigned long h = 0xcbf29ce484222325UL;
    for (int i = 0; i < 1024; i++) {
        h ^= blk_data[i];
        h *= 0x100000001b3UL;
    }
    blk_report("in", len);
    puts_("hash ");
    puthex(h);
    puts_("\n");
}

static unsigned int blk_read(int wait) {
    vbase = VIRTIO + 0x1000;
    if (vr(0x08) != 2) return 201;
    vw(0x14, 0);
    unsigned int feat = vr(0x10);
    if (!virtio_init_dev(2, BLK_RO | BLK_SEG_MAX)) return 202;
    if (!setup_queue(0, (unsigned long)q[0].d, (unsigned long)q[0].avail, (unsigned long)q[0].used))
        return 203;
    vw(0x70, 1 | 2 | 8 | 4);
    unsigned long cap = vr(0x100) | ((unsigned long)vr(0x104) << 32);
    puts_("ro ");
    puthex((feat & BLK_RO) != 0);
    puts_(" capacity ");
    puthex(cap);
    puts_(" seg_max ");
    puthex(vr(0x10c));
    puts_("\n");
    blk_in();
    if (wait) {
        puts_("WAIT\n");
        while (*GO_FLAG == 0) {}
        blk_in();
    }
    /* GET_ID */
    for (int i = 0; i < 20; i++) blk_id[i] = '#';
    blk_request(8, 0);
    blk_desc(1, blk_id, 20, 1 | 2);
    blk_desc(2, (void *)&blk_status, 1, 2);
    blk_report("id", blk_submit());
    puts_("id ");
    for (int i = 0; i < 20 && blk_id[i]; i++) outb(SERIAL, blk_id[i]);
    puts_("\n");
    /* OUT: refused */
    blk_request(1, 0);
    blk_desc(1, blk_data, 512, 1);
    blk_desc(2, (void *)&blk_status, 1, 2);
    blk_report("out", blk_submit());
    /* IN past the end: IOERR */
    blk_request(0, cap);
    blk_desc(1, blk_data, 512, 1 | 2);
    blk_desc(2, (void *)&blk_status, 1, 2);
    blk_report("past end", blk_submit());
    return vr(0x70);
}

unsigned int cmain(unsigned long cpu, unsigned long test, unsigned long ram) {
    switch (test) {
    case 0: /* hello */
        puts_("hello from the guest\n");
        return 42;
    case 1: /* computation, uninterrupted */
        puthex(compute(20000000UL, 0));
        puts_("\n");
        return 7;
    case 2: /* computation that waits for GO_FLAG halfway */
        puthex(compute(20000000UL, 1));
        puts_("\n");
        return 7;
    case 3: /* triple fault: hlt is privileged at CPL 3, and there is no IDT */
        __asm__ volatile("hlt");
        return 1;
    case 4: /* spin forever */
        for (;;) {}
    case 5: /* serial flood: 100000 bytes */
        for (int i = 0; i < 100000; i++) outb(SERIAL, 'x');
        return 5;
    case 6: /* unmapped MMIO: write and read the gap, and RAM-less space below it */
        *(volatile unsigned int *)0xe0000000UL = 0x12345678;
        *(volatile unsigned int *)(ram + 0x100000) = 1;
        return *(volatile unsigned int *)0xe0000000UL; /* 0xffffffff */
    case 7:
        return console_echo();
    case 8:
        return virtio_garbage_addr();
    case 9:
        return virtio_garbage_ring(ram);
    case 10: /* two vCPUs: the second reports in, the first waits for it */
        if (cpu == 1) {
            *AP_FLAG = 0xa9;
            for (;;) {}
        }
        while (*AP_FLAG != 0xa9) {}
        puts_("both vCPUs ran\n");
        return 10;
    case 11: /* wait for GO_FLAG, then exit */
        puts_("W");
        while (*GO_FLAG == 0) {}
        return 11;
    case 12: /* rep outsb to the serial port */
    {
        const char *src = ping;
        unsigned long n = sizeof(ping) - 1;
        __asm__ volatile("rep outsb" : "+S"(src), "+c"(n) : "d"((unsigned short)SERIAL) : "memory");
        return 12;
    }
    case 13:
        return blk_read(0);
    case 14: /* blk_read that waits for GO_FLAG after the first read (snapshot test) */
        return blk_read(1);
    case 15:
        return net_echo();
    case 16:
        return net_bad_then_good(0);
    case 17:
        return net_small_buffers();
    case 18: /* as 16, but waits for GO_FLAG before two more frames */
        return net_bad_then_good(1);
    case 19: /* fill 16 MiB from 16 MiB, wait for GO_FLAG, read it all back (sharing test) */
    {
        volatile unsigned long *mem = (volatile unsigned long *)0x1000000UL;
        unsigned long n = (16UL << 20) / 8, sum = 0;
        for (unsigned long i = 0; i < n; i++) mem[i] = i * 0x9e3779b97f4a7c15UL;
        puts_("F");
        while (*GO_FLAG == 0) {}
        for (unsigned long i = 0; i < n; i++) sum += mem[i] ^ i;
        puthex(sum);
        puts_("\n");
        return 19;
    }
    default:
        return 0xdead;
    }
}
