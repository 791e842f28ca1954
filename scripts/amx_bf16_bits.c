/* Do AMX's TDPBF16PS and AVX512-BF16's VDPBF16PS give the same float32 sums for the same bfloat16 pairs?
 * 200 trials of 16 rows x 16 outputs over 1024 features: one AMX tile product per 32 features, against
 * one vdpbf16ps chain per row over the same feature pairs in the same order. Prints the sums that
 * differ. An argument scales the inputs (e.g. 1e-3, 1e4).
 * Build and run on an AMX CPU: gcc -O2 -march=native scripts/amx_bf16_bits.c -o /tmp/amx_bf16_bits -lm && /tmp/amx_bf16_bits
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <math.h>
typedef struct { uint8_t palette_id, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;
static uint16_t bf(float f){ uint32_t u; memcpy(&u,&f,4); return (uint16_t)((u + 0x7fff + ((u>>16)&1))>>16);}
int main(int argc, char **argv){
  syscall(SYS_arch_prctl, 0x1023, 18);
  cfg_t c; memset(&c,0,sizeof c); c.palette_id=1; for(int t=0;t<8;t++){c.rows[t]=16;c.colsb[t]=64;} _tile_loadconfig(&c);
  int K = 1024; srand(1);
  int mism=0, total=0;
  double scale_x = argc>1 ? atof(argv[1]) : 1.0;
  for (int trial=0; trial<200; trial++){
    uint16_t *A = aligned_alloc(64, 16*K*2), *W = aligned_alloc(64, 16*K*2), *B = aligned_alloc(64, K/32*1024);
    for (int i=0;i<16*K;i++){ float g = ((rand()/(float)RAND_MAX)-0.5f)*scale_x * expf(((rand()%20)-10)*0.3f); A[i]=bf(g);}
    for (int i=0;i<16*K;i++){ float g = ((rand()/(float)RAND_MAX)-0.5f) * expf(((rand()%20)-10)*0.3f); W[i]=bf(g);}
    /* B tiles: tile[kp][j][e] = W[j][2kp+e] */
    for (int kb=0;kb<K/32;kb++) for(int kp=0;kp<16;kp++) for(int j=0;j<16;j++) for(int e=0;e<2;e++)
      B[kb*512 + kp*32 + j*2 + e] = W[j*K + kb*32 + 2*kp + e];
    float C[256] __attribute__((aligned(64)));
    _tile_zero(0);
    for (int kb=0;kb<K/32;kb++){ _tile_loadd(4, A+kb*32, K*2); _tile_loadd(6, B+kb*512, 64); _tile_dpbf16ps(0,4,6);}
    _tile_stored(0, C, 64);
    /* vdpbf16ps chain: lanes = 16 outputs, per row */
    for (int r=0;r<16;r++){
      __m512 acc = _mm512_setzero_ps();
      for (int kp=0; kp<K/2; kp++){
        uint32_t xp; memcpy(&xp, A + r*K + 2*kp, 4);
        __m512i wv = _mm512_loadu_si512(B + (kp/16)*512 + (kp%16)*32);
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(xp), (__m512bh)wv);
      }
      float o[16]; _mm512_storeu_ps(o, acc);
      for (int j=0;j<16;j++){ total++; if (memcmp(&o[j], &C[r*16+j], 4)) { if (mism<5) printf("r%d j%d amx %.9g dp %.9g\n", r,j,C[r*16+j],o[j]); mism++; } }
    }
    free(A); free(W); free(B);
  }
  printf("sums that differ: %d of %d\n", mism, total);
  _tile_release();
}
